"""The forwarder's streamed answers between two real HTTP servers on loopback (an owner and a forwarding host):
a caller that goes away closes the owner's stream too, and an owner that dies mid-stream ends an event stream
with an ``error`` event."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from moorage.devservices.postgres import free_port
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
