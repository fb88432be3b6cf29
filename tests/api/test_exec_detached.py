"""Exec in a sandbox over HTTP (process driver): synchronous, detached (202 + execution), output followed as it
arrives, bounded, timeout and cancel kill the process, another tenant sees nothing, a restart shows interrupted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from moorage.runtime import exec_jobs
from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

# Waits for a file the test creates later: the exec is still running when the POST has answered.
GATED = ["sh", "-c", "echo started; while [ ! -e go ]; do sleep 0.05; done; echo finished; echo oops >&2; exit 3"]


async def sandbox_of(live: Any, store: Store, secret: str, tmp_path: Path) -> str:
    async with aclient(live, secret) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u1"})).status_code == 200
    return store.tenant(store.authenticate(secret)).sandboxes.list()[0].id


async def settled(c: httpx.AsyncClient, location: str) -> dict[str, Any]:
    while True:
        view = (await c.get(location)).json()
        if view["status"] != "running":
            return view
        await asyncio.sleep(0.05)


async def sse(c: httpx.AsyncClient, url: str) -> AsyncIterator[tuple[str, Any]]:
    async with c.stream("GET", url) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                yield event or "message", json.loads(line[6:])


async def test_sync_and_detached_exec_with_streamed_output(live_rt, store: Store, globex: str, tmp_path: Path):
    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    async with aclient(live_rt, globex) as c:
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "echo hi; echo err >&2; exit 2"]})
        assert r.status_code == 200, r.text
        res = r.json()
        assert (res["status"], res["exit_code"], res["stdout"], res["stderr"]) == ("failed", 2, "hi\n", "err\n")

        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": GATED, "detach": True})
        assert r.status_code == 202, r.text
        ex = r.json()
        assert r.headers["location"] == f"/v1/executions/{ex['id']}"
        assert (ex["kind"], ex["status"], ex["sandbox_id"], ex["timeout_s"]) == ("exec", "running", sid, 60.0)

        seen: list[tuple[str, Any]] = []
        async for kind, data in sse(c, f"/v1/executions/{ex['id']}/output"):
            seen.append((kind, data))
            if kind == "output" and data["text"] == "started\n":
                # Streamed while the command still runs: only now is it let go.
                assert (await c.get(r.headers["location"])).json()["status"] == "running"
                done = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["touch", "go"]})
                assert done.json()["exit_code"] == 0
            if kind == "end":
                break
        out = "".join(d["text"] for k, d in seen if k == "output" and d["stream"] == "stdout")
        assert out == "started\nfinished\n"
        assert seen[-1][0] == "end" and seen[-1][1]["status"] == "failed" and seen[-1][1]["exit_code"] == 3

        view = await settled(c, r.headers["location"])
        assert (view["status"], view["exit_code"], view["stdout"], view["stderr"]) == ("failed", 3, "started\nfinished\n", "oops\n")
        assert view["truncated"] is False
        # After the end the stream replays what was kept, then the end.
        again = [k async for k, _ in sse(c, f"/v1/executions/{ex['id']}/output")]
        assert again[-1] == "end" and "output" in again
        # Cancelling an exec that ended is a conflict.
        assert (await c.post(f"/v1/executions/{ex['id']}/cancel")).status_code == 409

        # The same Idempotency-Key gives the same execution: the command runs once.
        once = {"argv": ["sh", "-c", "echo x >> runs"], "detach": True}
        first = await c.post(f"/v1/sandboxes/{sid}/exec", json=once, headers={"Idempotency-Key": "k1"})
        await settled(c, first.headers["location"])
        again = await c.post(f"/v1/sandboxes/{sid}/exec", json=once, headers={"Idempotency-Key": "k1"})
        assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
        assert again.json()["status"] == "succeeded"
        runs = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat", "runs"]})
        assert runs.json()["stdout"] == "x\n"


async def test_output_is_bounded(live_rt, store: Store, globex: str, tmp_path: Path):
    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    size = exec_jobs.KEEP_BYTES + 300_000
    async with aclient(live_rt, globex) as c:
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={
            "argv": ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' a; echo END"], "detach": True})
        view = await settled(c, r.headers["location"])
        assert view["status"] == "succeeded"
        assert view["truncated"] is True and view["stdout_bytes"] == size + 4
        assert len(view["stdout"]) == exec_jobs.KEEP_BYTES and view["stdout"].endswith("aaaEND\n")
        # The record keeps a shorter tail: a host that did not run it still shows how it ended.
        ts = store.tenant(store.authenticate(globex))
        fresh = exec_jobs.ExecJobs(live_rt.app.state.moorage.runtime).view(ts, ts.executions.get(view["id"]))
        assert fresh["status"] == "succeeded" and fresh["truncated"] is True
        assert 0 < len(fresh["stdout"]) <= exec_jobs.RECORD_BYTES and fresh["stdout"].endswith("aEND\n")
        assert fresh["stdout_bytes"] == size + 4


async def _gone(c: httpx.AsyncClient, sid: str) -> bool:
    """Whether the process whose pid the exec wrote is gone (kill -0 fails) within a few seconds: killed, it stays
    a zombie until the sandbox's init reaps it, which a loaded host may take a moment to do."""
    for _ in range(50):
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "kill -0 $(cat pid) 2>/dev/null"]})
        if r.json()["exit_code"] != 0:
            return True
        await asyncio.sleep(0.1)
    return False


PID_THEN_SLEEP = ["sh", "-c", "sleep 300 & echo $! > pid; echo ready; wait"]


async def test_timeout_and_cancel_kill_the_process(live_rt, store: Store, globex: str, tmp_path: Path):
    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    async with aclient(live_rt, globex) as c:
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": PID_THEN_SLEEP, "detach": True, "timeout_s": 1})
        assert r.status_code == 202 and r.json()["timeout_s"] == 1
        view = await settled(c, r.headers["location"])
        assert (view["status"], view["exit_code"], view["stdout"]) == ("timed_out", None, "ready\n")
        assert await _gone(c, sid)

        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": PID_THEN_SLEEP, "detach": True})
        ex = r.json()
        async for kind, data in sse(c, f"/v1/executions/{ex['id']}/output"):
            if kind == "output" and "ready" in data["text"]:
                break
        cancelled = await c.post(f"/v1/executions/{ex['id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert (await c.get(f"/v1/executions/{ex['id']}")).json()["status"] == "cancelled"
        assert await _gone(c, sid)

        bad = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"], "timeout_s": 0})
        assert bad.status_code == 422
        assert (await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": []})).status_code == 422


async def test_another_tenant_and_narrow_keys_get_nothing(live_rt, store: Store, acme: str, globex: str,
                                                          tmp_path: Path):
    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    async with aclient(live_rt, globex) as c:
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": GATED, "detach": True})
        ex_id = r.json()["id"]
        invoke_key = (await c.post("/v1/keys", json={"scopes": ["invoke"]})).json()["secret"]
    try:
        for secret, status in ((acme, 404), (invoke_key, None)):
            async with aclient(live_rt, secret) as other:
                r = await other.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["touch", "go"]})
                assert r.status_code == (status or 403), r.text
                assert (await other.get(f"/v1/executions/{ex_id}")).status_code == 404
                for method, url in (("POST", f"/v1/executions/{ex_id}/cancel"), ("GET", f"/v1/executions/{ex_id}/output")):
                    r = await other.request(method, url)
                    assert r.status_code == (status or 403), (url, r.text)
                    assert "started" not in r.text
    finally:
        async with aclient(live_rt, globex) as c:
            assert (await c.get(f"/v1/executions/{ex_id}")).json()["status"] == "running"  # untouched by them
            assert (await c.post(f"/v1/executions/{ex_id}/cancel")).json()["status"] == "cancelled"


async def test_after_a_restart_the_record_says_interrupted(live_rt, store: Store, globex: str, tmp_path: Path):
    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    runtime = live_rt.app.state.moorage.runtime
    async with aclient(live_rt, globex) as c:
        ex_id = (await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": GATED, "detach": True})).json()["id"]
        ts = store.tenant(store.authenticate(globex))
        # A new process on the same host holds none of the jobs of the one before it.
        after_restart = exec_jobs.ExecJobs(runtime).view(ts, ts.executions.get(ex_id))
        assert after_restart["status"] == "interrupted" and "stopped" in after_restart["error"]
        # The turn machinery never mistakes it for an async turn to resubmit or announce.
        assert ex_id not in [e.id for e in ts.executions.unsettled()]
        assert (await c.post(f"/v1/executions/{ex_id}/cancel")).json()["status"] == "cancelled"


async def test_sdk_exec_detached_follow_wait_cancel(live_rt, store: Store, globex: str, tmp_path: Path):
    from moorage import AsyncClient

    sid = await sandbox_of(live_rt, store, globex, tmp_path)
    async with AsyncClient(live_rt.url, globex) as c:
        res = await c.exec(sid, ["sh", "-c", "echo $X", "x"], env={"X": "from-env"})
        assert (res["status"], res["stdout"]) == ("succeeded", "from-env\n")
        # Output larger than a store value: a synchronous exec is answered, not journaled for replay.
        big = await c.exec(sid, ["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' b"])
        assert big["stdout"] == "b" * 300000
        ex = await c.exec_detached(sid, GATED, timeout_s=30)
        assert (ex["kind"], ex["status"]) == ("exec", "running")
        events = []
        async for ev in c.follow_exec(ex["id"]):
            events.append(ev)
            if ev["event"] == "output" and ev["data"]["text"] == "started\n":
                await c.exec(sid, ["touch", "go"])
        assert events[-1]["event"] == "end"
        done = await c.wait(ex["id"], poll_s=0.05)
        assert (done["status"], done["exit_code"], done["stdout"]) == ("failed", 3, "started\nfinished\n")

        await c.exec(sid, ["rm", "-f", "go"])
        ex = await c.exec_detached(sid, GATED)
        assert (await c.cancel_execution(ex["id"]))["status"] == "cancelled"
        assert (await c.wait(ex["id"]))["status"] == "cancelled"
