"""Retention runs every tenth checkpoint of an instance whatever its kind: an app that takes a checkpoint of its
own after each turn (or rolls back now and then) shifts the automatic ones off the multiples of ten, and before
that meant retention never ran: every checkpoint and its sandbox copy were kept for good."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

POLICY = "[agent.timetravel]\nauto = true\nkeep = 2\ndaily = 0\n"
BASE = "/v1/agents/tt/users/ada/checkpoints"


async def test_retention_runs_when_manual_checkpoints_take_the_tenth_places(live_rt, runtime, store: Store,  # noqa: F811
                                                                           acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, manifest=POLICY),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for i in range(1, 13):  # turn checkpoints take the odd places, manual ones (unnamed) the even ones
            r = await c.post("/v1/agents/tt/invoke", json={"message": f"turn {i}", "user": "ada"})
            assert r.status_code == 200, r.text
            assert (await c.post(BASE, json={})).status_code == 201
        listing = (await c.get(BASE)).json()
        assert max(x["seq"] for x in listing["data"]) == 24
        # Pruned at 10 and at 20 (keep = 2 and the branch's tip): what 21-24 added since.
        assert len(listing["data"]) <= 6, [x["seq"] for x in listing["data"]]
        sid = store.tenant(store.authenticate(acme)).sandboxes.list()[0].id
        on_disk = {h.name for h in await (await runtime.driver.open(sid)).checkpoints() if h.name.startswith("tt-")}
        assert on_disk == {x["sandbox_checkpoint"] for x in listing["data"]}  # their sandbox copies went too
