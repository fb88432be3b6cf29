"""The host's calls of guest methods as iterated streams (``Channel.stream`` and ``Channel.call``): each streamed
``Event``, the call's deadline, and its cancellation in the guest when the caller leaves early."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorage.sandbox.base import ChannelError, ChannelTimeout

if TYPE_CHECKING:
    from moorage.sandbox.channel import Channel, _Pending


@dataclass(frozen=True)
class Event:
    """One streamed event of a call: ``event`` name (e.g. "stdout") and its JSON ``data``."""

    event: str
    data: Any


class CallStream:
    """A call whose events are iterated: ``async with ch.stream(m, p) as s: async for ev in s: ...; s.result``.

    Leaving the ``async with`` block (or calling ``cancel()``) before the final response cancels the call in the guest.
    """

    def __init__(self, channel: "Channel", method: str, params: Any, timeout: float | None) -> None:
        self._channel = channel
        self._method = method
        self._params = params
        self._timeout = timeout
        self._id: int | None = None
        self._pending: _Pending | None = None
        self._deadline: float | None = None
        self.result: Any = None
        self.done = False

    async def _begin(self) -> None:
        if self._id is None:
            loop = asyncio.get_running_loop()
            self._deadline = None if self._timeout is None else loop.time() + self._timeout
            self._id, self._pending = await self._channel._start_call(self._method, self._params)

    async def __aenter__(self) -> "CallStream":
        await self._begin()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.done:
            await self.cancel()

    def __aiter__(self) -> "CallStream":
        return self

    async def __anext__(self) -> Event:
        await self._begin()
        assert self._pending is not None
        if self.done:
            raise StopAsyncIteration
        try:
            # ``asyncio.timeout``, not ``wait_for``: in Python 3.11, a cancel that comes in the loop step where an
            # event arrived is dropped by ``wait_for`` (it returns the event), and the caller runs on.
            async with asyncio.timeout_at(self._deadline):
                item = await self._pending.events.get()
        except TimeoutError:
            await self.cancel()
            raise ChannelTimeout(
                f"{self._method} got no answer within {self._timeout:g}s on {self._channel.name}",
                hint="the guest may be overloaded or hung; raise the timeout or restart the sandbox",
            ) from None
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel())
            raise
        if item is not None:
            ev, size = item
            self._pending.buffered_bytes -= size
            self._pending.drained.set()
            return ev
        self.done = True
        self.result = self._pending.future.result()  # raises RemoteError / ChannelClosed
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the peer to cancel this call; safe to call more than once or after it finished."""
        if self.done or self._id is None:
            self.done = True
            return
        self.done = True
        if self._pending is not None:
            self._pending.drained.set()  # a reader waiting for room in this call's buffer moves on
        self._channel._pending.pop(self._id, None)
        self._channel._forget_call(self._id)
        try:
            await self._channel.notify("$cancel", {"id": self._id})
        except ChannelError:
            pass
