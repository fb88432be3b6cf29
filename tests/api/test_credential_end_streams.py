"""A long-lived answer ended with the credential that opened it only on the app's WebSocket: a streamed turn (SSE,
and the OpenAI facade's stream), a JSON turn and an exec's output stream opened with a token that then expired, or
with a key then revoked, ran on to their end (a turn up to its 600 s), and the revoked key's turn went on spending
the tenant's model budget. Now each is checked again while it lasts: the stream ends with a final error event
(``credential-ended``), a JSON turn answers 401, and a revoked credential's turn is cancelled, while an expired
token's turn finishes detached (docs/security.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from moorage.api import credential_watch
from tests.api.conftest import aclient, agent_archive

SLOW_AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message.startswith("sleep "):
        await ctx.emit("token", "thinking ")  # the stream's answer starts at once
        await asyncio.sleep(float(message.split()[1]))
    return "echo: " + message
'''


@pytest.fixture(autouse=True)
def quick_recheck(monkeypatch) -> None:
    monkeypatch.setattr(credential_watch, "RECHECK_S", 0.2)


async def _deploy(c: Any, tmp_path: Path) -> None:
    r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=SLOW_AGENT),
                     headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text


async def _run_of(runtime: Any, user: str) -> str:
    """The run id of ``user``'s turn once it runs in its sandbox."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        bound = [b for b in list(runtime.turns.values()) if b.entity.user == user]
        if bound:
            return bound[0].run_id
        assert loop.time() < deadline, "the turn never started"
        await asyncio.sleep(0.02)


async def _status_within(c: Any, run_id: str, wanted: str, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        status = (await c.get(f"/v1/workflows/{run_id}")).json()["run"]["status"]
        if status == wanted:
            return
        assert loop.time() < deadline, f"run {run_id} is {status}, not {wanted}"
        await asyncio.sleep(0.1)


def _sse_events(body: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_revoked_key_ends_a_streamed_turn_with_an_error_event_and_cancels_it(live_rt, runtime, acme: str,
                                                                                     tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        issuer = (await c.post("/v1/keys", json={"scopes": ["deploy"]})).json()
        async with aclient(live_rt, issuer["secret"]) as backend:
            token = (await backend.post("/v1/agents/echo/users/ada/tokens", json={"ttl_s": 600})).json()["token"]
        async with aclient(live_rt, token) as browser:
            async with browser.stream("POST", "/v1/agents/echo/invoke?stream=true",
                                      json={"message": "sleep 60"}) as s:
                assert s.status_code == 200
                run_id = await _run_of(runtime, "ada")
                loop = asyncio.get_running_loop()
                revoked_at = loop.time()
                assert (await c.delete(f"/v1/keys/{issuer['id']}")).status_code == 200
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
                assert loop.time() - revoked_at < 15  # not the 60 s the turn would have run
        events = _sse_events(body)
        assert events[-1][0] == "error", body
        problem = events[-1][1]
        assert problem["type"] == "credential-ended" and problem["status"] == 401
        assert "revoked" in problem["detail"] and "cancelled" in problem["hint"]
        assert "done" not in [kind for kind, _ in events]
        # The turn stops spending the tenant's budget: its run is cancelled, not left running to its end.
        await _status_within(c, run_id, "cancelled", 15)


async def test_an_expired_token_ends_its_stream_but_the_turn_finishes(live_rt, runtime, acme: str,
                                                                      tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        # Awake already, so that the stream starts well within the token's life.
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bea"})).status_code == 200
        token = (await c.post("/v1/agents/echo/users/bea/tokens", json={"ttl_s": 3})).json()["token"]
        async with aclient(live_rt, token) as browser:
            async with browser.stream("POST", "/v1/agents/echo/invoke", headers={"accept": "text/event-stream"},
                                      json={"message": "sleep 8"}) as s:
                assert s.status_code == 200
                run_id = await _run_of(runtime, "bea")
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
                ended_at = asyncio.get_running_loop().time()
        kind, problem = _sse_events(body)[-1]
        assert kind == "error" and problem["type"] == "credential-ended", body
        assert "expired" in problem["detail"] and "finishes" in problem["hint"]
        status = (await c.get(f"/v1/workflows/{run_id}")).json()["run"]["status"]
        assert status == "running"  # the stream ended before the turn did
        await _status_within(c, run_id, "succeeded", 30)  # and the turn was not cancelled
        assert asyncio.get_running_loop().time() > ended_at


async def test_the_openai_stream_ends_with_its_own_error_shape_and_done(live_rt, runtime, acme: str,
                                                                        tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        key = (await c.post("/v1/keys", json={"scopes": ["invoke"]})).json()
        async with aclient(live_rt, key["secret"]) as app:
            async with app.stream("POST", "/v1/chat/completions",
                                  json={"model": "echo", "user": "cy", "stream": True,
                                        "messages": [{"role": "user", "content": "sleep 60"}]}) as s:
                assert s.status_code == 200
                run_id = await _run_of(runtime, "cy")
                assert (await c.delete(f"/v1/keys/{key['id']}")).status_code == 200
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
        datas = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert datas[-1] == "[DONE]", body
        error = json.loads(datas[-2])["error"]
        assert error["code"] == "credential-ended" and error["message"] and error["status"] == 401
        await _status_within(c, run_id, "cancelled", 15)


async def test_a_json_turn_whose_key_is_revoked_answers_401_and_is_cancelled(live_rt, runtime, acme: str,
                                                                             tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        key = (await c.post("/v1/keys", json={"scopes": ["invoke"]})).json()
        async with aclient(live_rt, key["secret"]) as app:
            turn = asyncio.create_task(app.post("/v1/agents/echo/invoke", json={"message": "sleep 60", "user": "dee"}))
            run_id = await _run_of(runtime, "dee")
            assert (await c.delete(f"/v1/keys/{key['id']}")).status_code == 200
            r = await asyncio.wait_for(turn, 15)
        assert r.status_code == 401 and r.json()["type"].endswith("credential-ended"), r.text
        await _status_within(c, run_id, "cancelled", 15)


async def test_a_live_credential_keeps_its_stream(live_rt, runtime, acme: str, tmp_path: Path) -> None:
    """Checked again many times over and still good: the stream runs to its ``done``."""
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        token = (await c.post("/v1/agents/echo/users/eve/tokens", json={"ttl_s": 600})).json()["token"]
        async with aclient(live_rt, token) as browser:
            async with browser.stream("POST", "/v1/agents/echo/invoke?stream=true", json={"message": "sleep 2"}) as s:
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
        kinds = [kind for kind, _ in _sse_events(body)]
        assert kinds[-1] == "done" and "error" not in kinds, body


async def test_an_exec_output_stream_ends_with_a_revoked_key(live_rt, runtime, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path)
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "fay"})).status_code == 200
        sid = (await c.get("/v1/agents/echo/users/fay")).json()["instance"]["sandbox_id"]
        key = (await c.post("/v1/keys", json={"scopes": ["deploy"]})).json()
        # Started by another key: an exec the revoked key started is cancelled by the revoke itself, so its stream
        # ends with the exec (tests/api/test_revoked_key_detached_work.py); this one only follows it.
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "60"], "detach": True})
        assert r.status_code == 202, r.text
        exec_id = r.json()["id"]
        async with aclient(live_rt, key["secret"]) as ops:
            async with ops.stream("GET", f"/v1/executions/{exec_id}/output") as s:
                assert s.status_code == 200
                loop = asyncio.get_running_loop()
                revoked_at = loop.time()
                assert (await c.delete(f"/v1/keys/{key['id']}")).status_code == 200
                body = b"".join([chunk async for chunk in s.aiter_bytes()])
                assert loop.time() - revoked_at < 15
        kind, problem = _sse_events(body)[-1]
        assert kind == "error" and problem["type"] == "credential-ended", body
        assert (await c.get(f"/v1/executions/{exec_id}")).json()["status"] == "running"  # only the stream ended
