"""What a product developer gets for a checkpoint id that is not this user's: a 404 whose hint names the listing
of this very user (not a template with {agent} and {user} left in), and nothing done to anyone."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive


async def test_another_users_or_an_unknown_checkpoint_is_a_404_naming_this_users_listing(live_rt, acme: str,  # noqa: F811
                                                                                       tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for user in ("ada", "bob"):
            for i in (1, 2):
                r = await c.post("/v1/agents/tt/invoke", json={"message": f"turn {i}", "user": user})
                assert r.status_code == 200, r.text
        before = {u: (await c.get(f"/v1/agents/tt/users/{u}/checkpoints")).json() for u in ("ada", "bob")}
        bobs = before["bob"]["data"][-1]["id"]
        base = "/v1/agents/tt/users/ada/checkpoints"
        for ref in (bobs, "ck00000000000000000000", "turn-1"):
            for path, body in ((f"{base}/{ref}/rollback", {}), (f"{base}/{ref}/fork", {"to_user": "cy"})):
                r = await c.post(path, json=body)
                assert r.status_code == 404, (path, r.text)
                problem = r.json()
                assert ref in problem["detail"] and "'ada'" in problem["detail"], problem
                assert problem["hint"] == "list them with GET /v1/agents/tt/users/ada/checkpoints", problem
        after = {u: (await c.get(f"/v1/agents/tt/users/{u}/checkpoints")).json() for u in ("ada", "bob")}
        assert after == before  # no before-rollback checkpoint, no branch, for either user
        assert (await c.get("/v1/agents/tt/users/cy")).status_code == 404
