"""A forward to an owner that stops answering (frozen, cut off: its kernel still accepts the connection) is waited on
only until the owner's lease lapses (``Forwarder.lapsed``), not for the eleven-minute read timeout, before its
answer starts and in the middle of a streamed one; an owner that answers while its lease holds is waited on as long
as it takes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import json
from typing import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moorage.fleet.forward import LET_GO, Forwarder, OwnerLapsed
from tests.fleet.test_forward_stream import _serve


class SilentOwner:
    """A listening socket that accepts connections and never answers, as a frozen host's kernel does; it notes
    when the forwarding host closes its connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with self.sock:
            conn, _ = self.sock.accept()
            with conn:
                while conn.recv(65536):  # the request arrives; nothing is sent back
                    pass
                self.closed.set()


def _front(forwarder: Forwarder, owner_url: str, how: str) -> Starlette:
    async def front(request: Request) -> Response:
        try:
            if how == "ask":
                r = await forwarder.ask(request, "owner", owner_url, {LET_GO: "1"})
                return Response(r.content, r.status_code)
            return await forwarder.forward(request, b"", "owner", owner_url)
        except OwnerLapsed as e:
            return JSONResponse({"lapsed": e.owner_id, "detail": e.message}, 503)

    return Starlette(routes=[Route("/x", front, methods=["DELETE"])])


@pytest.mark.parametrize("how", ["forward", "ask"])
def test_a_forward_to_an_owner_that_stops_answering_ends_when_its_lease_lapses(how: str) -> None:
    async def run() -> None:
        owner = SilentOwner()
        lapses_at = time.monotonic() + 1.5
        asked: list[str] = []

        def lapsed(host_id: str) -> bool:
            asked.append(host_id)
            return time.monotonic() >= lapses_at

        forwarder = Forwarder("front")
        forwarder.lapsed, forwarder.watch_every_s = lapsed, 0.2
        server, task, url = await _serve(_front(forwarder, owner.url, how))
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                t0 = time.monotonic()
                r = await c.delete("/x")
                waited = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["lapsed"] == "owner", r.text
            assert "lease lapsed" in r.json()["detail"]
            assert 1.0 <= waited < 10, waited  # until the lease lapsed, not the read timeout
            assert set(asked) == {"owner"} and len(asked) >= 3  # asked again each watch period while it waited
            assert await asyncio.to_thread(owner.closed.wait, 10)  # the connection to the frozen owner is closed
        finally:
            server.should_exit = True
            await asyncio.gather(task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())


def test_an_owner_answering_slowly_while_its_lease_holds_is_waited_on() -> None:
    async def run() -> None:
        async def slow(request: Request) -> Response:
            await asyncio.sleep(1.0)
            return JSONResponse({"served": "owner"})

        owner, owner_task, owner_url = await _serve(Starlette(routes=[Route("/x", slow, methods=["DELETE"])]))
        asked: list[str] = []
        forwarder = Forwarder("front")
        forwarder.lapsed, forwarder.watch_every_s = (lambda h: asked.append(h) or False), 0.1
        fronting, front_task, front_url = await _serve(_front(forwarder, owner_url, "forward"))
        try:
            async with httpx.AsyncClient(base_url=front_url, timeout=60) as c:
                r = await c.delete("/x")
            assert r.status_code == 200 and r.json() == {"served": "owner"}, r.text
            assert len(asked) >= 3  # the owner's lease was looked at while it answered
        finally:
            owner.should_exit = fronting.should_exit = True
            await asyncio.gather(owner_task, front_task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())


def test_a_stream_whose_owner_stops_in_the_middle_ends_with_an_error_event_once_its_lease_lapses() -> None:
    async def run() -> None:
        owner_closed = asyncio.Event()
        lapses: list[float] = []

        async def stalls(request: Request) -> Response:
            async def events() -> AsyncIterator[bytes]:
                try:
                    yield b"event: token\ndata: 1\n\n"
                    lapses.append(time.monotonic() + 1.5)  # it sends nothing more, the connection stays open
                    await asyncio.sleep(3600)
                finally:
                    owner_closed.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        owner, owner_task, owner_url = await _serve(Starlette(routes=[Route("/s", stalls)]))
        forwarder = Forwarder("front")
        forwarder.lapsed = lambda h: bool(lapses) and time.monotonic() >= lapses[0]
        forwarder.watch_every_s = 0.2

        async def front(request: Request) -> Response:
            return await forwarder.forward(request, b"", "owner", owner_url)

        fronting, front_task, front_url = await _serve(Starlette(routes=[Route("/s", front)]))
        try:
            async with httpx.AsyncClient(base_url=front_url, timeout=60) as c:
                t0 = time.monotonic()
                async with c.stream("GET", "/s") as r:
                    lines = [line async for line in r.aiter_lines()]
                waited = time.monotonic() - t0
            assert lines[0] == "event: token" and "event: error" in lines, lines
            problem = json.loads(next(line for line in lines if line.startswith("data:") and "status" in line)[5:])
            assert problem["status"] == 503 and "owner" in problem["detail"]
            assert 1.0 <= waited < 10, waited
            await asyncio.wait_for(owner_closed.wait(), 10)  # the connection to the owner was closed
        finally:
            owner.should_exit = fronting.should_exit = True
            await asyncio.gather(owner_task, front_task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())
