"""The forwarder's streamed answers between two real HTTP servers on loopback (an owner and a forwarding host):
a caller that goes away closes the owner's stream too, and an owner that dies mid-stream ends an event stream
with an ``error`` event."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any, AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from moorage.devservices.postgres import free_port
from moorage.errors import UnavailableError
from moorage.fleet.forward import Forwarder


async def _serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


def test_a_caller_going_away_closes_the_owners_stream_and_a_lost_owner_ends_it_with_an_error_event() -> None:
    async def run() -> None:
        owner_closed = asyncio.Event()
        sent_one = asyncio.Event()

        async def endless(request: Request) -> Response:
            async def events() -> AsyncIterator[bytes]:
                try:
                    yield b"event: token\ndata: 1\n\n"
                    sent_one.set()
                    while True:  # nothing more until the reader goes away
                        await asyncio.sleep(3600)
                finally:
                    owner_closed.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        async def dies(request: Request) -> Response:
            async def events() -> AsyncIterator[bytes]:
                yield b"event: token\ndata: 1\n\n"
                await sent_one.wait()
                raise RuntimeError("the owner dies mid-stream")  # the server drops the connection, body unfinished

            return StreamingResponse(events(), media_type="text/event-stream")

        owner, owner_task, owner_url = await _serve(Starlette(routes=[Route("/stream", endless), Route("/dies", dies)]))
        forwarder = Forwarder("front")

        async def front(request: Request) -> Response:
            return await forwarder.forward(request, b"", "owner", owner_url, "ab" * 16)

        fronting, front_task, front_url = await _serve(Starlette(routes=[Route("/stream", front), Route("/dies", front)]))
        try:
            async with httpx.AsyncClient(base_url=front_url, timeout=60) as c:
                async with c.stream("GET", "/stream") as r:
                    assert r.status_code == 200 and r.headers["x-moorage-served-by"] == "owner"
                    lines = r.aiter_lines()
                    assert await lines.__anext__() == "event: token"
                    assert not owner_closed.is_set()
            # The caller went away: the forwarding host closed its connection, so the owner's stream ended.
            await asyncio.wait_for(owner_closed.wait(), 60)

            # The owner dies in the middle of a stream: the caller's event stream ends with an error event.
            sent_one.clear()
            async with httpx.AsyncClient(base_url=front_url, timeout=60) as c:
                async with c.stream("GET", "/dies") as r:
                    lines = r.aiter_lines()
                    assert await lines.__anext__() == "event: token"
                    sent_one.set()
                    rest = [line async for line in lines]
            events = [json.loads(line[5:]) for line in rest if line.startswith("data:")]
            assert "event: error" in rest and events[-1]["status"] == 503 and "owner" in events[-1]["detail"]
        finally:
            owner.should_exit = fronting.should_exit = True
            await asyncio.gather(owner_task, front_task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())


def test_a_stream_silent_longer_than_the_answer_wait_goes_through_and_an_owner_that_never_answers_is_a_503() -> None:
    # The owner's answer must begin within answer_wait_s (11 minutes; 1 s here); once it streams, a silence of any
    # length is the owner app's to keep (a long poll), not cut by a read timeout.
    async def run() -> None:
        async def quiet(request: Request) -> Response:
            async def body() -> AsyncIterator[bytes]:
                yield b"first "
                await asyncio.sleep(2.5)
                yield b"then the rest"

            return StreamingResponse(body(), media_type="text/plain")

        released = asyncio.Event()

        async def mute(request: Request) -> Response:
            await released.wait()
            return Response(b"too late")

        owner, owner_task, owner_url = await _serve(Starlette(routes=[Route("/quiet", quiet), Route("/mute", mute)]))
        forwarder = Forwarder("front")
        forwarder.answer_wait_s = 1.0

        async def front(request: Request) -> Response:
            try:
                return await forwarder.forward(request, b"", "owner", owner_url, "ab" * 16)
            except UnavailableError as e:  # what the API's handler answers it with
                return Response(e.message, 503)

        fronting, front_task, front_url = await _serve(Starlette(routes=[Route("/quiet", front), Route("/mute", front)]))
        try:
            async with httpx.AsyncClient(base_url=front_url, timeout=60) as c:
                r = await c.get("/quiet")
                assert (r.status_code, r.text) == (200, "first then the rest")
                # The connection to the owner, kept for the next request, finds a vanished peer by TCP keepalive.
                port = owner_url.rsplit(":", 1)[1]
                held = subprocess.run(["ss", "-tno", "state", "established", "dport", f"= :{port}"],
                                      capture_output=True, text=True, timeout=30).stdout
                assert "timer:(keepalive" in held, held
                started = asyncio.get_running_loop().time()
                r = await c.get("/mute")
                assert r.status_code == 503 and "did not answer: TimeoutError" in r.text, r.text
                assert asyncio.get_running_loop().time() - started < 10
        finally:
            released.set()
            owner.should_exit = fronting.should_exit = True
            await asyncio.gather(owner_task, front_task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())
