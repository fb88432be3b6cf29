"""The guest's app relay (``guest/app_relay.py``) against a real TCP app: an ``app.read`` the host cancels in the
loop step the app's bytes arrive is cancelled, and the bytes stay for the next read (Python 3.11's ``wait_for``
handed them to the cancelled call, whose host had gone, and the app's stream lost them)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from moorage.guest.app_relay import AppRelay


async def test_a_read_cancelled_as_the_apps_bytes_arrive_leaves_them_for_the_next_read() -> None:
    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)  # answers once poked, so the relay's read is waiting when the bytes come
        writer.write(b"hello")
        await writer.drain()
        await reader.read()  # holds the connection until the relay closes it
        writer.close()

    server = await asyncio.start_server(app, "127.0.0.1", 0)
    relay = AppRelay()
    try:
        cid = (await relay.open({"port": server.sockets[0].getsockname()[1]}, None))["conn"]  # type: ignore[arg-type]
        reader: Any = relay._conns[cid].reader
        reading = asyncio.ensure_future(relay.read({"conn": cid}, None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not reading.done()
        feed = reader.feed_data

        def arrive_and_cancel(data: bytes) -> None:  # the host's $cancel lands in the step the bytes arrive
            feed(data)
            reading.cancel()

        reader.feed_data = arrive_and_cancel
        await relay.write({"conn": cid, "data": base64.b64encode(b"x").decode()}, None)  # type: ignore[arg-type]
        with pytest.raises(asyncio.CancelledError):
            await reading
        reader.feed_data = feed
        got = await relay.read({"conn": cid}, None)  # type: ignore[arg-type]
        assert base64.b64decode(got["data"]) == b"hello" and got["eof"] is False
        assert (await relay.close({"conn": cid}, None))["closed"] is True  # type: ignore[arg-type]
    finally:
        if relay._reaper is not None:
            relay._reaper.cancel()
        server.close()
        await server.wait_closed()
