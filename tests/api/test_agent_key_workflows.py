"""A key limited to one agent lists, reads, answers and cancels that agent's workflow runs (naming the agent on
the listing), and no other agent's: those are refused or not found, and stay as they were."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_a_key_for_one_agent_answers_that_agents_approvals_only(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as admin:
        runs = {}
        for name in ("echo", "other"):
            assert (await admin.post(f"/v1/agents/{name}/deployments", content=agent_archive(tmp_path, name),
                                     headers=GZ)).status_code == 201
            for user in ("u1", "u2"):
                r = await admin.post(f"/v1/agents/{name}/invoke", json={"message": "approve", "user": user})
                assert r.json()["status"] == "waiting", r.text
                runs[name, user] = r.json()["run_id"]
        key = (await admin.post("/v1/keys", json={"scopes": ["invoke", "read"], "agent": "echo"})).json()["secret"]
        reader = (await admin.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})).json()["secret"]
    async with aclient(live_rt, key) as c:
        # The listing names its agent: without it, or with another, it is refused (not silently filtered).
        for params in ({}, {"agent": "other"}):
            r = await c.get("/v1/workflows", params=params)
            assert r.status_code == 403 and "agent=echo" in r.json()["hint"], r.text
        listed = (await c.get("/v1/workflows", params={"agent": "echo", "status": "waiting"})).json()["data"]
        assert sorted(r["id"] for r in listed) == sorted([runs["echo", "u1"], runs["echo", "u2"]])
        # Another agent's run is not found, whatever is asked of it.
        theirs = runs["other", "u1"]
        assert (await c.get(f"/v1/workflows/{theirs}")).status_code == 404
        assert (await c.post(f"/v1/workflows/{theirs}/answer", json={"answer": "yes"})).status_code == 404
        assert (await c.post(f"/v1/workflows/{theirs}/cancel")).status_code == 404
        # Its own: read, answered, cancelled.
        mine = runs["echo", "u1"]
        detail = (await c.get(f"/v1/workflows/{mine}")).json()
        assert detail["run"]["status"] == "waiting"
        r = await c.post(f"/v1/workflows/{mine}/answer", json={"answer": "yes"})
        assert r.status_code == 200 and r.json()["reply"] == "draft-1 -> yes", r.text
        r = await c.post(f"/v1/workflows/{runs['echo', 'u2']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    async with aclient(live_rt, reader) as c:  # may read them, not answer
        r = await c.post(f"/v1/workflows/{runs['other', 'u2']}/answer", json={"answer": "yes"})
        assert r.status_code == 403, r.text
    async with aclient(live_rt, acme) as admin:  # the other agent's runs were left alone
        for user in ("u1", "u2"):
            assert (await admin.get(f"/v1/workflows/{runs['other', user]}")).json()["run"]["status"] == "waiting"
