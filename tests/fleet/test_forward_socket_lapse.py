"""An app WebSocket relayed to an owner host that stops answering is closed with 1012 (connect again) once the
owner's lease lapses, not when its pings run out 40 s later; the owner's lease is looked at once per watch period
however many sockets go to it, and a socket to an owner whose lease holds stays open, quiet or not."""

from __future__ import annotations

import asyncio
import time

from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from moorage.fleet.forward import Forwarder
from moorage.ws_close import SERVICE_RESTART
from tests.fleet.test_forward_stream import _serve


def _owner(went_away: asyncio.Event) -> Starlette:
    """Echoes the first message, then reads nothing more and sends nothing (as a host that froze); notes when the
    forwarding host's connection goes."""

    async def app(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text(await ws.receive_text())
        try:
            await ws.receive()  # the forwarding host sends nothing more: what arrives is its going away
        finally:
            went_away.set()

    return Starlette(routes=[WebSocketRoute("/s", app)])


def _front(forwarder: Forwarder, owner_url: str) -> Starlette:
    async def front(ws: WebSocket) -> None:
        sock = await forwarder.open_socket(ws, "owner", owner_url, max_message=1 << 20, open_timeout_s=5)
        await ws.accept()
        await sock.relay(ws)

    return Starlette(routes=[WebSocketRoute("/s", front)])


def test_a_socket_to_an_owner_that_stops_answering_closes_with_1012_when_its_lease_lapses() -> None:
    async def run() -> None:
        went_away = asyncio.Event()
        owner, owner_task, owner_url = await _serve(_owner(went_away))
        asked: list[tuple[str, float]] = []
        lapses_at = float("inf")

        def lapsed(host_id: str) -> bool:
            asked.append((host_id, time.monotonic()))
            return time.monotonic() >= lapses_at

        forwarder = Forwarder("front")
        forwarder.lapsed, forwarder.watch_every_s = lapsed, 0.2
        fronting, front_task, front_url = await _serve(_front(forwarder, owner_url))
        try:
            url = front_url.replace("http", "ws") + "/s"
            sockets = [await connect(url) for _ in range(3)]
            for i, s in enumerate(sockets):
                await s.send(f"hello {i}")
                assert await asyncio.wait_for(s.recv(), 10) == f"hello {i}"
            asked.clear()
            await asyncio.sleep(1.0)  # quiet, its lease held: open still, and looked at once a period for all three
            assert all(s.state.name == "OPEN" for s in sockets)
            assert {h for h, _ in asked} == {"owner"} and 3 <= len(asked) <= 7, asked

            lapses_at = time.monotonic() + 0.5
            for s in sockets:
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(s.recv(), 10)
                    raise AssertionError("a message from a frozen owner")
                except ConnectionClosed as e:
                    assert e.rcvd is not None and e.rcvd.code == SERVICE_RESTART, e
                    assert "connect again" in e.rcvd.reason
                assert time.monotonic() - t0 < 5  # once the lease lapsed, not the 40 s the pings take
            await asyncio.wait_for(went_away.wait(), 10)  # the connection to the owner is dropped
            asked.clear()
            await asyncio.sleep(0.6)
            assert asked == []  # no socket left to it: its lease is no longer looked at
        finally:
            owner.should_exit = fronting.should_exit = True
            await asyncio.gather(owner_task, front_task, return_exceptions=True)
            await forwarder.close()

    asyncio.run(run())
