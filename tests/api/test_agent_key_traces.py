"""Traces of one agent: ``GET /v1/traces?agent=`` lists that agent's spans (its users' turns and the requests
about them), and a key limited to one agent reads its agent's spans and traces only (it could read none: every
trace route spans agents and refused it), naming the agent on the listing as for workflow runs."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


def _agent_of(span: dict) -> str | None:
    if span["scope"]:
        return span["scope"].split(":", 1)[1].split("/", 1)[0]
    return span["attrs"].get("moorage.agent")


async def _all(c, params: dict) -> list[dict]:  # noqa: ANN001
    spans, cursor = [], None
    while True:
        r = await c.get("/v1/traces", params={**params, "limit": 200, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        spans += r.json()["data"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return spans


async def test_a_key_for_one_agent_reads_that_agents_traces_only(live_rt, acme: str, tmp_path: Path) -> None:  # noqa: ANN001
    traces = {}
    async with aclient(live_rt, acme) as admin:
        for name in ("echo", "other"):
            assert (await admin.post(f"/v1/agents/{name}/deployments", content=agent_archive(tmp_path, name),
                                     headers=GZ)).status_code == 201
            r = await admin.post(f"/v1/agents/{name}/invoke", json={"message": "hi", "user": "u1"})
            assert r.status_code == 200, r.text
            traces[name] = r.json()["trace_id"]
        key = (await admin.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})).json()["secret"]
        # Any key may ask for one agent's spans: only that agent's come back, its turn among them.
        mine = await _all(admin, {"agent": "echo"})
        assert mine and {_agent_of(s) for s in mine} == {"echo"}, {_agent_of(s) for s in mine}
        assert any(s["trace_id"] == traces["echo"] and s["name"] == "turn" for s in mine)
        everything = await _all(admin, {})
        assert {_agent_of(s) for s in everything} >= {"echo", "other"}
    async with aclient(live_rt, key) as c:
        for params in ({}, {"agent": "other"}):  # the listing names its agent: never a silent filter
            r = await c.get("/v1/traces", params=params)
            assert r.status_code == 403 and "agent=echo" in r.json()["hint"], r.text
        assert {_agent_of(s) for s in await _all(c, {"agent": "echo"})} == {"echo"}
        r = await c.get(f"/v1/traces/{traces['echo']}")
        assert r.status_code == 200 and r.json()["spans"], r.text
        assert {_agent_of(s) for s in r.json()["spans"]} == {"echo"}
        assert (await c.get(f"/v1/traces/{traces['other']}")).status_code == 404  # another agent's: not found
