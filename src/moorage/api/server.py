"""The HTTP server's connections: uvicorn's h11 protocol with a deadline for each request's headers, and one for a
client that stops reading its answer.

uvicorn closes only a kept-alive connection that stays idle; one that sends its headers a byte at a time (or never
starts) was held for good, so anyone could hold every file descriptor of the host with a few thousand sockets. A
client that sends a request and never reads the answer held it too, with the answer's bytes in the host's memory
and, for a stream, the stream and its end-user's place.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Seconds a connection may take to send a request's headers (from its opening, or from the previous answer).
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds a connection may take nothing of its answer while the server has more of it to send.
DEFAULT_WRITE_STALL_S = 60.0


class HeaderDeadline(H11Protocol):
    """Closes a connection whose request headers are not complete within ``header_timeout_s``: counted from the
    connection's opening and again from each answer; a request whose headers arrived is not timed by it (its body and
    its answer are the route's)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    write_stall_s: float = DEFAULT_WRITE_STALL_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._body: asyncio.TimerHandle | None = None
        self._awaited: Any = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._awaited = self.scope  # the last request's scope: a new one means the next headers arrived
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.scope is not self._awaited:
            self._disarm()  # a request's headers came in time (a WebSocket upgrade's too)
        self._watch_body()

    # A request's body must keep coming: a pause of ``header_timeout_s`` while it is awaited closes the connection
    # (a body that stopped halfway held it, and the request's handler, for good). Not while the server itself has
    # stopped reading (its buffer full, the handler not reading yet): that pause is the server's.
    def _body_awaited(self) -> bool:
        return (self.conn.their_state is h11.SEND_BODY and self.conn.our_state is not h11.DONE
                and self.cycle is not None and self.cycle.scope is self.scope  # not a WebSocket's handshake
                and self.transport.get_protocol() is self and not self.transport.is_closing())

    def _watch_body(self) -> None:
        if self._body is not None:
            self._body.cancel()
            self._body = None
        if self._body_awaited():
            self._body = self.loop.call_later(self.header_timeout_s, self._body_stopped)

    def _body_stopped(self) -> None:
        self._body = None
        if not self._body_awaited():
            return
        if self.flow.read_paused:
            self._watch_body()
            return
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Now the next request's headers are awaited (unless a pipelined one was already read in full).
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.scope is not self._awaited:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request in progress: its headers came
        self.transport.close()

    # The transport's buffer of unsent bytes is full (the client takes nothing): it has ``write_stall_s`` to take
    # some, or the connection is dropped; the answer's sender (blocked on the buffer) then sees it gone.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().resume_writing()

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            self.transport.abort()  # close() would wait for the unread bytes to leave first

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for timer in (self._stall, self._body):
            if timer is not None:
                timer.cancel()
        self._stall = self._body = None
        super().connection_lost(exc)


def header_deadline(timeout_s: float, write_stall_s: float = DEFAULT_WRITE_STALL_S) -> type[HeaderDeadline]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for headers due within ``timeout_s`` and
    answers dropped once their reader took nothing for ``write_stall_s``."""
    return type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": float(timeout_s),
                                                      "write_stall_s": float(write_stall_s)})
