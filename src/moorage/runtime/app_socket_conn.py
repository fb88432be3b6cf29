"""The guest side of an app's WebSocket as the host holds it: one relayed connection to the app's port (``app.open``
in ``guest/app_relay.py``), bytes written in frames and pulled one chunk at a time, and how each call can fail.
"""

from __future__ import annotations

import base64
import contextlib
import time
from typing import Any

from moorage.runtime.app_errors import AppUnavailable
from moorage.runtime.app_guest import READ_CHUNK, WRITE_CHUNK
from moorage.sandbox import ChannelError, ChannelTimeout, RemoteError

#: The guest drops a socket's connection when the host has not asked for its bytes for this long: the host keeps a
#: read waiting at all times (each waits at most 25 s in the guest), so only a host that went away stops asking.
GUEST_IDLE_S = 60
#: Longest one channel call waits for the guest (its ``app.read`` answers within 25 s, with bytes or without).
READ_CALL_S = 35.0


class InstanceGone(Exception):
    """The instance went to sleep (or its channel closed) under the socket."""


class AppStalled(Exception):
    """The app took none of the bytes written to it for ``app_timeout_s`` (it stopped reading its socket)."""


def too_slow() -> AppUnavailable:
    return AppUnavailable("the agent's app took too long to answer the WebSocket handshake",
                          hint="make the app answer sooner, or raise app_timeout_s")


class GuestConnection:
    """One relayed connection to the app's port: bytes written in frames, bytes pulled one chunk at a time."""

    def __init__(self, channel: Any, conn_id: int, write_timeout_s: float) -> None:
        self.channel = channel
        self.conn_id = conn_id
        self.closed = False
        #: How long one write may wait for the app to take its bytes (the guest's write waits on the app's socket).
        self.write_timeout_s = write_timeout_s

    async def write(self, data: bytes, *, eof: bool = False) -> None:
        for i in range(0, max(len(data), 1), WRITE_CHUNK):
            params: dict[str, Any] = {"conn": self.conn_id, "data": base64.b64encode(data[i:i + WRITE_CHUNK]).decode()}
            if eof and i + WRITE_CHUNK >= len(data):
                params["eof"] = True
            try:
                await self._call("app.write", params, self.write_timeout_s)
            except InstanceGone as e:
                if isinstance(e.__cause__, ChannelTimeout):
                    raise AppStalled() from None
                raise

    async def read(self, until: float | None = None) -> bytes | None:
        """The app's next bytes (None at its end of stream), waiting for them until ``until`` (or for ever)."""
        while True:
            # The guest answers an empty read only after waiting up to 25 s: a deadline sooner than that ends the
            # call itself (its cancel frees the guest's read), so an app that never answers costs app_timeout_s.
            left = READ_CALL_S if until is None else until - time.monotonic()
            if left <= 0:
                raise too_slow()
            try:
                got = await self._call("app.read", {"conn": self.conn_id, "max": READ_CHUNK}, min(left, READ_CALL_S))
            except InstanceGone as e:
                if until is not None and isinstance(e.__cause__, ChannelTimeout):
                    raise too_slow() from None
                raise
            data = base64.b64decode(got.get("data") or "") if isinstance(got, dict) else b""
            if data:
                return data
            if not isinstance(got, dict) or got.get("eof"):
                return None
            # An empty read without eof: the guest waited its longest for the app; ask again.

    async def _call(self, method: str, params: dict[str, Any], timeout: float = READ_CALL_S) -> Any:
        try:
            return await self.channel.call(method, params, timeout=timeout)
        except RemoteError:
            return {"data": "", "eof": True}  # the guest no longer has the connection: the app's end of stream
        except ChannelError as e:
            raise InstanceGone() from e

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self.channel.call("app.close", {"conn": self.conn_id}, timeout=5)
