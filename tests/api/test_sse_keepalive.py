"""Server-sent event streams keep quiet connections alive: a comment line (``: keep-alive``) after
``sse_keepalive_s`` of silence, which every SSE client skips, so that proxies and the fleet's forwarding do not cut a
turn or an exec that says nothing for a while. The frames themselves, their order, errors and the caller leaving
are as without it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

import openai
import pytest

from moorage.api.sse import KEEPALIVE, with_keepalive
from moorage.client import AsyncClient
from moorage.config import Config
from moorage.store import Store
from tests.api.conftest import aclient, agent_archive, serve_runtime

QUIET = '''
import asyncio

async def on_message(ctx, message):
    if message == "silent":
        await asyncio.sleep(0.6)  # quiet from the start (a cold start, a long first call)
        return "late"
    await ctx.emit("token", "thinking ")
    await asyncio.sleep(0.6)  # a long model call or tool: nothing to say meanwhile
    return "done thinking"
'''


async def _collect(frames: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in frames]


async def test_silence_between_frames_gets_keepalives_and_frames_keep_their_order() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0.35)
        yield b"b"
        yield b"c"

    out = await _collect(with_keepalive(frames(), 0.1))
    assert out[0] == b"a" and out[-2:] == [b"b", b"c"]
    assert 2 <= out.count(KEEPALIVE) <= 4 and set(out[1:-2]) == {KEEPALIVE}
    # 0: as they come, nothing added.
    assert await _collect(with_keepalive(frames(), 0)) == [b"a", b"b", b"c"]


async def test_an_error_of_the_frames_reaches_the_caller_after_what_came_before() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("the source failed")

    got = []
    with pytest.raises(ValueError, match="the source failed"):
        async for chunk in with_keepalive(frames(), 0.1):
            got.append(chunk)
    assert got == [b"a"]


async def test_a_caller_that_leaves_ends_the_frames_it_was_reading() -> None:
    ended = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            await asyncio.sleep(3600)
            yield b"never"
        finally:
            ended.set()

    stream = with_keepalive(frames(), 0.05)
    assert await stream.__anext__() == b"a"
    assert await stream.__anext__() == KEEPALIVE
    await stream.aclose()
    assert ended.is_set()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "sse-frames"]


async def test_a_quiet_streamed_turn_over_http_gets_keepalives_and_clients_skip_them(runtime, store: Store, tmp_path: Path) -> None:
    secret = store.operator.create_tenant("acme")[1].secret
    async with serve_runtime(runtime, Config(data_dir=tmp_path / "data", sse_keepalive_s=0.1)) as live:
        async with aclient(live, secret) as c:
            r = await c.post("/v1/agents/quiet/deployments", content=agent_archive(tmp_path, "quiet", QUIET),
                             headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
            async with c.stream("POST", "/v1/agents/quiet/invoke?stream=true", json={"message": "hi", "user": "u1"}) as r:
                assert r.status_code == 200
                raw = (await r.aread()).decode()
            # Between the token and the reply the turn was quiet for 0.6 s: comments filled it.
            token, done = raw.index("event: token"), raw.index("event: done")
            assert raw.count(": keep-alive\n\n", token, done) >= 2  # every 0.1 s; a loaded host may send fewer
            assert ": keep-alive" not in raw[done:]
            # Quiet from the start: the answer does not wait for a first event; keep-alives come before it.
            async with c.stream("POST", "/v1/agents/quiet/invoke?stream=true", json={"message": "silent", "user": "u1"}) as r:
                assert r.status_code == 200
                raw = (await r.aread()).decode()
            assert raw.count(": keep-alive\n\n", 0, raw.index("event: done")) >= 3 and '"reply": "late"' in raw
            # A refusal found at once still has its own status.
            r = await c.post("/v1/agents/nobody/invoke?stream=true", json={"message": "hi", "user": "u1"})
            assert r.status_code == 404

            # The SDK and the OpenAI-compatible stream's clients see only the events.
            async with AsyncClient(live.url, secret) as sdk:
                events = [e async for e in sdk.stream("quiet", "again", user="u1")]
            assert [e["event"] for e in events] == ["token", "done"] and events[-1]["data"]["reply"] == "done thinking"
            async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=secret, max_retries=0) as oa:
                chunks = await oa.chat.completions.create(model="quiet", user="u1", stream=True,
                                                          messages=[{"role": "user", "content": "once more"}])
                text = "".join([ch.choices[0].delta.content or "" async for ch in chunks])
            assert text == "thinking "

            # A detached exec that prints nothing for a while: its followed output gets them too. It stays quiet
            # until the test has the output open (on a loaded host a fixed sleep could end before the GET, and
            # then the whole output is replayed at once, with nothing to keep alive).
            sid = store.tenant(store.authenticate(secret)).sandboxes.list()[0].id
            r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": [
                "sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done; sleep 0.5; echo late"], "detach": True})
            assert r.status_code == 202, r.text
            async with c.stream("GET", r.headers["location"] + "/output") as out:
                assert out.status_code == 200
                go = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["touch", "/tmp/go"]})
                assert go.status_code == 200, go.text
                raw = (await out.aread()).decode()
            assert raw.index(": keep-alive") < raw.index("late") < raw.index("event: end")
