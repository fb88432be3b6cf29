"""Checkpoint names the store refuses (empty, over 100 characters, a NUL) are refused before anything is taken:
no sandbox half is left on disk that no listed checkpoint names (nothing would ever delete it), and a sleeping
instance is not woken for it. Unicode, spaces and a name several checkpoints share are accepted."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

BASE = "/v1/agents/tt/users/ada/checkpoints"


async def test_a_bad_name_is_refused_before_the_sandbox_half_is_taken(live_rt, runtime, store: Store,  # noqa: F811
                                                                     acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "ada"})).status_code == 200
        sid = store.tenant(store.authenticate(acme)).sandboxes.list()[0].id
        sandbox = await runtime.driver.open(sid)

        async def halves() -> tuple[list[str], list[str]]:
            listed = sorted(x["sandbox_checkpoint"] for x in (await c.get(BASE)).json()["data"])
            return listed, sorted(h.name for h in await sandbox.checkpoints() if h.name.startswith("tt-"))

        for bad in ("x" * 101, "", "a\x00b"):
            r = await c.post(BASE, json={"name": bad})
            assert r.status_code == 422 and "1-100 characters" in r.json()["detail"], r.text
            r = await c.post(f"/v1/sandboxes/{sid}/checkpoint", json={"label": bad})
            assert r.status_code == 422, r.text
            r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"label": bad, "to_users": ["bea"]})
            assert r.status_code == 422, r.text
        listed, on_disk = await halves()
        assert len(listed) == 1 and on_disk == listed  # the turn's checkpoint, and nothing unnamed beside it
        assert (await c.get("/v1/agents/tt/users/bea")).status_code == 404

        for good in ("проверка ✓ 🚀", "dup", "dup", "y" * 100):
            r = await c.post(BASE, json={"name": good})
            assert r.status_code == 201 and r.json()["name"] == good, r.text
        listed, on_disk = await halves()
        assert len(listed) == 5 and on_disk == listed

        # Asleep: a refused name does not wake the instance.
        assert (await c.post(f"/v1/sandboxes/{sid}/sleep", json={})).status_code == 200
        assert (await c.post(BASE, json={"name": "z" * 101})).status_code == 422
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] != "running"
