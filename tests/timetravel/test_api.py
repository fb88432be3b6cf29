"""The checkpoint routes over HTTP on both store backends: list, take, roll back, fork; and every one of them
refused across tenants, to keys without their scope, to keys of another agent and to end-user tokens."""

from __future__ import annotations

import json
from pathlib import Path

from moorage.store import Store
from tests.api.conftest import acme, aclient, globex, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

BASE = "/v1/agents/tt/users/ada/checkpoints"


async def _deploy_and_turns(live, secret: str, tmp_path: Path, n: int) -> None:
    async with aclient(live, secret) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for i in range(1, n + 1):
            r = await c.post("/v1/agents/tt/invoke", json={"message": f"turn {i}", "user": "ada"})
            assert r.json()["reply"] == f"done {i} step={i * 10} files={i}", r.text


async def test_list_take_rollback_fork_over_http(live_rt, acme: str, tmp_path: Path) -> None:  # noqa: F811
    await _deploy_and_turns(live_rt, acme, tmp_path, 3)
    async with aclient(live_rt, acme) as c:
        listing = (await c.get(BASE)).json()
        assert [x["summary"]["turn"]["message"] for x in listing["data"]] == ["turn 3", "turn 2", "turn 1"]
        assert listing["data"][0]["summary"]["turn"]["steps"] == [{"name": "side-3", "status": "succeeded"}]
        assert listing["store_bytes"] > 0 and listing["sandbox_bytes"] > 0  # storage of this user's checkpoints
        two = listing["data"][1]["id"]

        taken = await c.post(BASE, json={"name": "before the experiment"})
        assert taken.status_code == 201 and taken.json()["kind"] == "manual"

        r = await c.post(f"{BASE}/{two}/rollback", json={})
        assert r.status_code == 200, r.text
        assert r.json()["rolled_back_to"] == two
        reply = (await c.post("/v1/agents/tt/invoke", json={"message": "ls", "user": "ada"})).json()["reply"]
        assert sorted(json.loads(reply)) == ["1.txt", "2.txt"]
        branches = (await c.get(BASE)).json()["branches"]
        assert len(branches) == 2 and sum(b["current"] for b in branches) == 1

        assert (await c.put("/v1/agents/tt/users/ada", json={"metadata": {"plan": "pro"}})).status_code in (200, 201)
        r = await c.post(f"{BASE}/{two}/fork", json={"to_users": ["bea", "cy"]})
        assert r.status_code == 201, r.text
        assert [f["user"] for f in r.json()["forks"]] == ["bea", "cy"]
        for u in ("bea", "cy"):
            reply = (await c.post("/v1/agents/tt/invoke", json={"message": "ls", "user": u})).json()["reply"]
            assert sorted(json.loads(reply)) == ["1.txt", "2.txt"]
            assert (await c.get(f"/v1/agents/tt/users/{u}")).json()["metadata"] == {"plan": "pro"}  # a user like any
            forked = (await c.get(f"/v1/agents/tt/users/{u}/checkpoints")).json()["data"]
            assert forked[-1]["kind"] == "fork" and forked[-1]["summary"]["forked_from"]["checkpoint"] == two
        r = await c.post(f"{BASE}/{two}/fork", json={"to_user": "bea"})
        assert r.status_code == 409  # bea exists now
        assert (await c.post(f"{BASE}/nope/rollback", json={})).status_code == 404


async def test_checkpoint_routes_refuse_other_tenants_scopes_agents_and_users(live_rt, store: Store, acme: str,  # noqa: F811
                                                                             globex: str, tmp_path: Path) -> None:
    await _deploy_and_turns(live_rt, globex, tmp_path, 2)
    async with aclient(live_rt, globex) as c:
        victim = (await c.get(BASE)).json()
        ck = victim["data"][0]["id"]
        read_key = (await c.post("/v1/keys", json={"scopes": ["read"]})).json()["secret"]
        other_agent_key = (await c.post("/v1/keys", json={"scopes": ["provision", "read"], "agent": "other"})).json()["secret"]
        token = (await c.post("/v1/agents/tt/users/ada/tokens", json={})).json()["token"]
    routes = [("GET", BASE, None), ("POST", BASE, {"name": "x"}), ("POST", f"{BASE}/{ck}/rollback", {}),
              ("POST", f"{BASE}/{ck}/fork", {"to_user": "thief"})]
    # Another tenant: the agent and the checkpoint do not exist there.
    async with aclient(live_rt, acme) as c:
        for method, path, body in routes:
            r = await c.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            assert "turn 1" not in r.text and victim["data"][0]["sandbox_id"] not in r.text  # nothing of the victim
    # The victim's own keys, without the scope, for another agent, or an end-user token: refused.
    for secret, statuses in ((read_key, {"GET": 200, "POST": 403}), (other_agent_key, {"GET": 403, "POST": 403}),
                             (token, {"GET": 403, "POST": 403})):
        async with aclient(live_rt, secret) as c:
            for method, path, body in routes:
                r = await c.request(method, path, json=body)
                assert r.status_code == statuses[method], (secret[:6], method, path, r.status_code, r.text)
    async with aclient(live_rt, globex) as c:
        after = (await c.get(BASE)).json()
        assert [x["id"] for x in after["data"]] == [x["id"] for x in victim["data"]]  # nothing was taken or rolled
        assert (await c.get("/v1/agents/tt/users/thief/checkpoints")).status_code == 404  # no fork made thief


async def test_the_sandbox_verbs_checkpoint_roll_back_and_fork_the_whole_instance(live_rt, store: Store,  # noqa: F811
                                                                                  acme: str, tmp_path: Path) -> None:
    """`POST /v1/sandboxes/{id}/checkpoint|rollback|fork` act on the whole instance, as the checkpoint routes do: a
    sandbox rolled back alone would leave the user's memory and journal where they were. The routes' own scope
    (deploy) is enough."""
    await _deploy_and_turns(live_rt, acme, tmp_path, 2)
    ts = store.tenant(store.authenticate(acme))
    sid = ts.sandboxes.list()[0].id
    async with aclient(live_rt, acme) as admin:
        deploy_key = (await admin.post("/v1/keys", json={"scopes": ["deploy"]})).json()["secret"]

        async def ask(user: str, message: str) -> str:
            r = await admin.post("/v1/agents/tt/invoke", json={"message": message, "user": user})
            assert r.status_code == 200, r.text
            return r.json()["reply"]

        async with aclient(live_rt, deploy_key) as c:
            r = await c.post(f"/v1/sandboxes/{sid}/checkpoint", json={"label": "after-two"})
            assert r.status_code == 200, r.text
            ck = r.json()["checkpoint"]
            listed = {x["id"]: x for x in (await admin.get(BASE)).json()["data"]}
            assert listed[ck]["kind"] == "manual" and listed[ck]["name"] == "after-two"
            assert await ask("ada", "turn 3") == "done 3 step=30 files=3"

            # Rolled back by the checkpoint's name: files and memory together.
            r = await c.post(f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": "after-two"})
            assert r.status_code == 200, r.text
            assert r.json()["rolled_back_to"] == ck and r.json()["abandoned"]["tip"]
            assert sorted(json.loads(await ask("ada", "ls"))) == ["1.txt", "2.txt"]
            assert json.loads(await ask("ada", "recall milestone reached")) == [
                "milestone 1 reached by the user", "milestone 2 reached by the user"]
            assert await ask("ada", "turn 3") == "done 3 step=30 files=3"  # as a first turn 3 would

            # Forked as it is now into a new user, who starts with all of it; ada is unchanged.
            r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"to_users": ["bea"]})
            assert r.status_code == 200, r.text
            assert [x["user"] for x in r.json()["forks"]] == ["bea"]
            assert sorted(json.loads(await ask("bea", "ls"))) == ["1.txt", "2.txt", "3.txt"]
            assert await ask("bea", "turn 4") == "done 4 step=40 files=4"
            assert sorted(json.loads(await ask("ada", "ls"))) == ["1.txt", "2.txt", "3.txt"]

            # Bad input is refused before anything is taken: no stray checkpoint.
            before = len((await admin.get(BASE)).json()["data"])
            for body, status in (({}, 422), ({"to_users": ["ada"]}, 422), ({"to_users": "bea"}, 422),
                                 ({"to_user": "bea"}, 409)):
                r = await c.post(f"/v1/sandboxes/{sid}/fork", json=body)
                assert r.status_code == status, (body, r.text)
            assert (await c.post(f"/v1/sandboxes/{sid}/rollback", json={})).status_code == 422
            assert (await c.post(f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": "nope"})).status_code == 404
            assert len((await admin.get(BASE)).json()["data"]) == before
