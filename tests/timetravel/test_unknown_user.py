"""Time travel on a user id that names nobody (a typo) is a 404 that creates nothing: not the user (even for an agent
whose users are made on their first turn), not an instance, not a checkpoint."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive


async def test_checkpoint_verbs_on_an_unknown_user_are_404_and_create_nothing(live_rt, store: Store, acme: str,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "ada"})).status_code == 200
        ck = (await c.get("/v1/agents/tt/users/ada/checkpoints")).json()["data"][0]["id"]

        typo = "/v1/agents/tt/users/adda/checkpoints"
        for method, path, body in [("POST", typo, {"name": "before"}), ("POST", f"{typo}/{ck}/rollback", {}),
                                   ("POST", f"{typo}/{ck}/fork", {"to_users": ["bea"]})]:
            r = await c.request(method, path, json=body)
            assert r.status_code == 404, (path, r.text)
            assert "adda" in r.json()["detail"], r.text
        assert (await c.get("/v1/agents/tt/users/adda")).status_code == 404
        assert (await c.get("/v1/agents/tt/users/bea")).status_code == 404
    scopes = [r.scope.user for t in store.operator.tenants() for r in t.sandboxes.list(limit=100)]
    assert scopes == ["ada"]
