"""Turns over HTTP with the real runtime: deploy a tar.gz, invoke (JSON and SSE), end-user tokens,
idempotent retries, interrupts answered over HTTP, rollback, forget; on both store backends."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive


async def deploy(c: httpx.AsyncClient, tmp_path: Path, name: str = "echo", version: str = "") -> dict:
    r = await c.post(f"/v1/agents/{name}/deployments", content=agent_archive(tmp_path, name, version=version),
                     headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text
    return r.json()


def sse_events(text: str) -> list[tuple[str, object]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_deploy_invoke_and_stream(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        dep = await deploy(c, tmp_path)
        assert dep["number"] == 1 and "package_ref" not in dep
        assert (await c.get("/v1/agents/echo")).json()["live_deployment"] == dep["id"]

        r = await c.post("/v1/agents/echo/invoke", json={"message": "hello", "user": "alice", "session": "s1"})
        assert r.status_code == 200, r.text
        turn = r.json()
        assert turn["status"] == "done" and turn["reply"] == "echo: hello"

        r = await c.post("/v1/agents/echo/invoke?stream=true", json={"message": "stream a b c", "user": "alice"})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        tokens = [e for k, e in events if k == "token"]
        assert "".join(t["data"] for t in tokens) == "a b c "
        assert events[-1][0] == "done" and events[-1][1]["reply"] == "streamed"

        r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bob"},
                         headers={"Accept": "text/event-stream"})
        assert sse_events(r.text)[-1][1]["reply"] == "echo: hi"

        # Refusals before the first event keep their status even when streaming was asked for.
        r = await c.post("/v1/agents/nobody/invoke?stream=true", json={"message": "hi", "user": "bob"})
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")

        events = (await c.get("/v1/agents/echo/users/alice/events", params={"session": "s1"})).json()["data"]
        assert [e["content"] for e in events] == ["hello", "echo: hello"]


async def test_deploy_refuses_bad_archives_and_name_mismatch(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        gz = {"content-type": "application/gzip"}
        assert (await c.post("/v1/agents/echo/deployments", content=b"not gzip", headers=gz)).status_code == 422
        assert (await c.post("/v1/agents/echo/deployments", content=b"\x1f\x8bgarbage", headers=gz)).status_code == 422
        r = await c.post("/v1/agents/other/deployments", content=agent_archive(tmp_path, "echo"), headers=gz)
        assert r.status_code == 422 and "echo" in r.json()["detail"]


async def test_end_user_tokens_act_for_one_user_of_one_agent(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        await deploy(c, tmp_path, "other")
        tok = (await c.post("/v1/agents/echo/users/alice/tokens", json={"ttl_s": 600})).json()["token"]
        assert tok.startswith("mrgu_")
    async with aclient(live_rt, tok) as u:
        r = await u.post("/v1/agents/echo/invoke", json={"message": "whoami"})
        assert r.json()["reply"] == "user=alice"
        assert (await u.post("/v1/agents/echo/invoke", json={"message": "whoami", "user": "bob"})).status_code == 403
        assert (await u.post("/v1/agents/other/invoke", json={"message": "whoami"})).status_code == 403
        assert (await u.get("/v1/agents/echo/users/bob/events")).status_code == 403
        assert (await u.get("/v1/agents/echo/users/alice/events")).status_code == 200
        assert (await u.get("/v1/agents")).status_code == 403
        assert (await u.get("/v1/keys")).status_code == 403
        assert (await u.post("/v1/agents/echo/users/alice/tokens", json={})).status_code == 403
        assert (await u.delete("/v1/agents/echo/users/alice")).status_code == 403
        # A forged header cannot widen the token.
        r = await u.post("/v1/agents/echo/invoke", json={"message": "whoami"}, headers={"X-Moorage-User": "bob"})
        assert r.json()["reply"] == "user=alice"
    tampered = tok[:-3] + ("AAA" if not tok.endswith("AAA") else "BBB")
    async with aclient(live_rt, tampered) as u:
        assert (await u.post("/v1/agents/echo/invoke", json={"message": "whoami"})).status_code == 401


async def test_idempotent_invoke_runs_the_turn_once(live_rt, acme, tmp_path: Path, store: Store):
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        h = {"Idempotency-Key": "turn-1"}
        a = (await c.post("/v1/agents/echo/invoke", json={"message": "once", "user": "u1"}, headers=h)).json()
        b = (await c.post("/v1/agents/echo/invoke", json={"message": "once", "user": "u1"}, headers=h)).json()
        assert a["turn_id"] == b["turn_id"] and a["reply"] == b["reply"] == "echo: once"
        events = (await c.get("/v1/agents/echo/users/u1/events", params={"session": "default"})).json()["data"]
        assert [e["content"] for e in events] == ["once", "echo: once"]


async def test_interrupt_answered_over_http_and_workflow_views(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        r = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "u1"})).json()
        assert r["status"] == "waiting" and r["interrupt"]["question"] == "ship it?"
        run_id = r["run_id"]
        waiting = (await c.get("/v1/workflows", params={"status": "waiting"})).json()["data"]
        assert [w["id"] for w in waiting] == [run_id]
        detail = (await c.get(f"/v1/workflows/{run_id}")).json()
        assert detail["run"]["status"] == "waiting"
        done = await c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"})
        assert done.status_code == 200, done.text
        assert done.json()["reply"] == "draft-1 -> yes"
        again = await c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"})
        assert again.status_code == 409
        assert (await c.post(f"/v1/workflows/{run_id}/cancel")).status_code == 409
        r2 = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "u2"})).json()
        cancelled = await c.post(f"/v1/workflows/{r2['run_id']}/cancel")
        assert cancelled.json()["status"] == "cancelled"


async def test_rollback_and_forget(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path, version="1")
        await deploy(c, tmp_path, version="2")
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "x", "user": "u1"})).json()["reply"] == "echo2: x"
        back = await c.post("/v1/agents/echo/rollback", json={"number": 1})
        assert back.status_code == 200 and back.json()["number"] == 1
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "y", "user": "u1"})).json()["reply"] == "echo1: y"
        deps = (await c.get("/v1/agents/echo/deployments")).json()["data"]
        assert [d["number"] for d in deps] == [1, 2]

        fact = await c.post("/v1/agents/echo/users/u1/facts", json={"subject": "user", "attribute": "city", "value": "Oslo"})
        assert fact.status_code == 201 and fact.json()["action"] == "inserted"
        moved = await c.post("/v1/agents/echo/users/u1/facts", json={"subject": "user", "attribute": "city", "value": "Rome"})
        assert moved.json()["action"] == "superseded" and moved.json()["previous"]["value"] == "Oslo"
        current = (await c.get("/v1/agents/echo/users/u1/facts", params={"attribute": "city"})).json()["data"]
        assert [f["value"] for f in current] == ["Rome"]
        before = fact.json()["fact"]["valid_from"] + 1e-6
        as_of = (await c.get("/v1/agents/echo/users/u1/facts", params={"attribute": "city", "as_of": before})).json()
        assert [f["value"] for f in as_of["data"]] == ["Oslo"]

        gone = await c.delete("/v1/agents/echo/users/u1")
        assert gone.status_code == 200 and gone.json()["removed"] > 0
        # No such user now (a listing answers 404 only when it has nothing to list): no facts, no log.
        assert (await c.get("/v1/agents/echo/users/u1/facts")).status_code == 404
        assert (await c.get("/v1/agents/echo/users/u1/events", params={"session": "default"})).status_code == 404
