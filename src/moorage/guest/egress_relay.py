"""The guest end of an agent's network: a proxy address inside the sandbox whose connections go to the host.

Stdlib only. Started only in sandboxes of agents that declare ``[agent.network]`` (the host puts
``MOORAGE_NETWORK=1`` and ``HTTP(S)_PROXY`` in their environment). Each connection to 127.0.0.1:3128 becomes a
host call (``egress.open``) and its bytes travel in frames (``egress.send``/``egress.recv``) to the host's egress
gateway, which decides every request; the sandbox has no network device, so nothing else leaves it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from typing import Any, Optional

from .rpc import METHOD_NOT_FOUND, Peer, Registry, RpcError, log

PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128
CHUNK = 256 * 1024
#: How long a new connection waits for the host to be connected and serving egress (a wake, a first turn).
ATTACH_WAIT_S = 15.0


class EgressRelay:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def _peer(self) -> Optional[Peer]:
        for peer in list(getattr(self.registry, "peers", ()) or ()):
            if not peer.closed:
                return peer
        return None

    async def _open(self) -> "tuple[Peer, int]":
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            peer = self._peer()
            if peer is not None:
                try:
                    opened = await peer.call("egress.open", {}, timeout=30)
                    return peer, int(opened["conn"])
                except RpcError as e:
                    # The host registers its egress handlers when it first serves this sandbox after a wake.
                    if e.code != METHOD_NOT_FOUND or time.monotonic() > deadline:
                        raise
            elif time.monotonic() > deadline:
                raise RpcError("the host is not connected")
            await asyncio.sleep(0.1)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer, conn = await self._open()
        except (RpcError, asyncio.TimeoutError, OSError) as e:
            log("egress connection refused", error=str(e)[:200])
            writer.close()
            return

        async def up() -> None:
            while True:
                data = await reader.read(CHUNK)
                await peer.call("egress.send", {"conn": conn, "data": base64.b64encode(data).decode(), "eof": not data},
                                timeout=60)
                if not data:
                    return

        async def down() -> None:
            while True:
                got = await peer.call("egress.recv", {"conn": conn, "max": CHUNK}, timeout=60)
                data = base64.b64decode(got.get("data") or "")
                if data:
                    writer.write(data)
                    await writer.drain()
                if got.get("eof"):
                    return

        sending = asyncio.ensure_future(up())
        try:
            await down()
        except (RpcError, asyncio.TimeoutError, OSError, ValueError):
            pass
        finally:
            sending.cancel()
            try:
                await peer.call("egress.close", {"conn": conn}, timeout=10)
            except (RpcError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
            writer.close()


def register(registry: Registry) -> None:
    if os.environ.get("MOORAGE_NETWORK") != "1":
        return
    relay = EgressRelay(registry)

    async def listen() -> None:
        try:
            server = await asyncio.start_server(relay.handle, PROXY_HOST, PROXY_PORT)
        except OSError as e:
            log("egress proxy address unavailable", error=str(e))
            return
        log("egress proxy listening", port=PROXY_PORT)
        async with server:
            await server.serve_forever()

    registry.egress_listener = asyncio.get_running_loop().create_task(listen())  # type: ignore[attr-defined]
