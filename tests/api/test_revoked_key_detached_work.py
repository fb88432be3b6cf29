"""Revoking an API key cancelled the turns of requests it had open, but the work it started detached ran on: its
async turns (queued or running, its own or an end-user token's it issued) and its detached execs, each up to its
end (a turn up to 600 s, an exec up to its timeout), spending the tenant's budget. Now each ends ``cancelled`` within
seconds, with an error that names the key (in the run, the execution and its webhook), and the work of another key
of the same tenant runs on to its end (docs/security.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from moorage.store import Store
from moorage.webhooks.delivery import announce
from tests.api.conftest import aclient, agent_archive

SLOW_AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message.startswith("sleep "):
        await asyncio.sleep(float(message.split()[1]))
    return "echo: " + message
'''

ASYNC = {"prefer": "respond-async"}


async def _status_within(c: Any, execution_id: str, wanted: set[str], seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        ex = (await c.get(f"/v1/executions/{execution_id}")).json()
        if ex["status"] in wanted:
            return ex
        assert loop.time() < deadline, f"execution {execution_id} is {ex['status']}, not {wanted}: {ex}"
        await asyncio.sleep(0.1)


async def _submit(c: Any, user: str, message: str, session: str = "default") -> str:
    r = await c.post("/v1/agents/echo/invoke", headers=ASYNC, json={"message": message, "user": user,
                                                                    "session": session})
    assert r.status_code == 202, r.text
    return r.json()["id"]


async def _exec(c: Any, sandbox_id: str, seconds: int) -> str:
    r = await c.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"argv": ["sleep", str(seconds)], "detach": True,
                                                               "timeout_s": 120})
    assert r.status_code == 202, r.text
    return r.json()["id"]


async def test_a_revoked_key_cancels_its_queued_and_running_async_turns_and_detached_execs(
        live_rt, runtime, store: Store, acme: str, globex: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as admin:
        r = await admin.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=SLOW_AGENT),
                             headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        hook = (await admin.post("/v1/agents/echo/webhooks", json={"url": "https://example.invalid/hook"})).json()
        leaked = (await admin.post("/v1/keys", json={"scopes": ["invoke", "deploy"], "label": "leaked"})).json()
        kept = (await admin.post("/v1/keys", json={"scopes": ["invoke", "deploy"], "label": "kept"})).json()
        for user in ("ada", "bea", "cy"):  # their instances exist, so execs have sandboxes to run in
            r = await admin.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})
            assert r.status_code == 200, r.text
        sandboxes = {s["scope"].split(":", 1)[1].split("/")[1]: s["id"]
                     for s in (await admin.get("/v1/sandboxes")).json()["data"]}
        async with aclient(live_rt, leaked["secret"]) as k, aclient(live_rt, kept["secret"]) as o:
            token = (await k.post("/v1/agents/echo/users/cy/tokens", json={"ttl_s": 600})).json()["token"]
            running = await _submit(k, "ada", "sleep 60", session="s")
            queued = await _submit(k, "ada", "sleep 1", session="s")  # in line behind the first
            async with aclient(live_rt, token) as browser:
                r = await browser.post("/v1/agents/echo/invoke", headers=ASYNC, json={"message": "sleep 60"})
                assert r.status_code == 202, r.text
                by_token = r.json()["id"]
            exec_k = await _exec(k, sandboxes["bea"], 60)
            theirs = await _submit(o, "bea", "sleep 3")
            exec_o = await _exec(o, sandboxes["cy"], 3)
            for ex in (running, by_token, theirs):
                await _status_within(admin, ex, {"running"}, 60)
            assert (await _status_within(admin, queued, {"queued"}, 1))["status"] == "queued"
            # Another tenant cannot revoke the key, nor so end its work: the 404 of a key that does not exist.
            async with aclient(live_rt, globex) as stranger:
                r = await stranger.delete(f"/v1/keys/{leaked['id']}")
                assert r.status_code == 404, r.text
            await asyncio.sleep(1.5)  # a check of this host's detached work passed meanwhile
            for ex in (running, by_token, exec_k):
                assert (await admin.get(f"/v1/executions/{ex}")).json()["status"] == "running"
            assert (await admin.get(f"/v1/executions/{queued}")).json()["status"] == "queued"
            loop = asyncio.get_running_loop()
            revoked_at = loop.time()
            assert (await admin.delete(f"/v1/keys/{leaked['id']}")).status_code == 200
            for ex in (running, queued, by_token, exec_k):
                end = await _status_within(admin, ex, {"cancelled", "succeeded", "failed", "timed_out"}, 15)
                assert end["status"] == "cancelled", end
                assert leaked["id"] in end["error"] and "revoked" in end["error"], end
            assert loop.time() - revoked_at < 15  # not the 60 s each would have run
            # The queued turn never started: no run of its own was made.
            wf = await admin.get(f"/v1/workflows/{queued}")
            assert wf.status_code == 404, wf.text
            # The other key's work of the same tenant runs to its end.
            assert (await _status_within(admin, theirs, {"succeeded", "failed", "cancelled"}, 60))["status"] == "succeeded"
            done = await _status_within(admin, exec_o, {"succeeded", "failed", "cancelled", "timed_out"}, 60)
            assert done["status"] == "succeeded", done
        # What the product's webhook is told of each cancelled turn: cancelled, naming the key.
        ts = store.tenant(store.authenticate(acme))
        await asyncio.to_thread(announce, ts)
        page = (await admin.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries", params={"limit": 50})).json()
        told = {d["payload"]["data"]["execution_id"]: d for d in page["data"]}
        for ex in (running, queued, by_token):
            d = told[ex]
            assert d["event"] == "execution.cancelled" and leaked["id"] in d["payload"]["data"]["error"], d
        assert told[theirs]["event"] == "execution.succeeded"


async def test_every_queued_turn_of_a_revoked_key_is_cancelled_however_many_wait(
        live_rt, runtime, store: Store, acme: str, monkeypatch: Any) -> None:
    """The revoke read the key's queued turns once, at most a page of them (1,000): a key that had queued more left
    the rest to start. It now reads page after page; the page is shortened here to 2 so that 7 turns span four.
    They were queued on no host of this one's (made in the store, as a turn waiting for a host to take it is)."""
    from moorage.runtime import revoked_work

    monkeypatch.setattr(revoked_work, "QUEUED_PAGE", 2)
    async with aclient(live_rt, acme) as admin:
        leaked = (await admin.post("/v1/keys", json={"scopes": ["invoke"], "label": "leaked"})).json()
        kept = (await admin.post("/v1/keys", json={"scopes": ["invoke"], "label": "kept"})).json()
        ts = store.tenant(store.authenticate(acme))
        ids = [f"queued-{i}" for i in range(7)]
        for i, ex_id in enumerate(ids):
            ts.executions.create(ex_id, "echo", f"u{i}", "default", {"message": "hi"}, leaked["id"])
        ts.executions.create("other-key", "echo", "u0", "default", {"message": "hi"}, kept["id"])
        assert (await admin.delete(f"/v1/keys/{leaked['id']}")).status_code == 200
        for ex_id in ids:
            ex = (await admin.get(f"/v1/executions/{ex_id}")).json()
            assert ex["status"] == "cancelled" and leaked["id"] in ex["error"], ex
        assert (await admin.get("/v1/executions/other-key")).json()["status"] == "queued"
