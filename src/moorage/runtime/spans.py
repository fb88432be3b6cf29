"""The spans of a turn's guest calls and of the turn itself, recorded into the tenant's own store: held while the
turn runs and written with its last commit (``Tracer.flush``), bounded per turn, also exported where configured."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from moorage.log import get_logger
from moorage.observability import events
from moorage.runtime.host_calls import TurnBinding
from moorage.store import Span

log = get_logger("moorage.runtime.runtime")


class Tracer:
    """Records spans of guest calls and turns into the tenant's own store (tenant-scoped trace reads).

    Spans of a turn in progress are held and written with the turn's last commit (``flush``), so tracing adds
    no commit of its own to a turn; a host killed mid-turn loses that turn's spans, never its journal.
    """

    #: Spans one turn holds at most; past it they are written in a commit of their own, off the event loop.
    BUFFER = 256
    #: Spans one turn records at most: a guest that makes thousands of calls in a turn costs its store, and the
    #: host's commits, no more than this; the rest are counted and logged once per turn.
    MAX_PER_TURN = 2048

    def __init__(self) -> None:
        self._held: dict[str, list[Span]] = {}
        self._counts: dict[str, int] = {}
        self._writes: set[asyncio.Future[None]] = set()
        #: Where each span is also exported as it ends (``otlp_endpoint``); None: the store only.
        self.sink: Any = None

    def open(self, turn_id: str) -> None:
        """Hold the spans of ``turn_id`` until ``flush``."""
        self._held.setdefault(turn_id, [])

    def close(self, turn_id: str) -> None:
        """Stop holding spans of ``turn_id``; any not flushed are dropped."""
        self._held.pop(turn_id, None)
        self._done(turn_id)

    def _done(self, turn_id: str) -> None:
        dropped = self._counts.pop(turn_id, 0) - self.MAX_PER_TURN
        if dropped > 0:
            log.warning("spans of a turn over its limit were not recorded", turn=turn_id, dropped=dropped)

    def span(self, b: TurnBinding, name: str, started_perf: float, status: str = "ok", **attrs: Any) -> None:
        if name == "turn":  # every turn ends with this span: its metrics, however it ended
            events.turn_ended(status, time.perf_counter() - started_perf, attrs, b.usage)
        if b.turn_id in self._held:
            count = self._counts[b.turn_id] = self._counts.get(b.turn_id, 0) + 1
            if count > self.MAX_PER_TURN:
                return
        end = time.time()
        start = end - (time.perf_counter() - started_perf)
        span = Span(b.trace_id, uuid.uuid4().hex[:16], None, name, start, end, status,
                    {"agent": b.entity.agent, "user": b.entity.user, "session": b.entity.session, **attrs},
                    b.session_scope)
        if self.sink is not None:
            try:
                self.sink.export(b.ts.tenant_id, span)
            except Exception as e:  # noqa: BLE001 - exporting never breaks a turn
                log.warning("span not exported", error=str(e))
        held = self._held.get(b.turn_id)
        if held is not None:
            held.append(span)
            if len(held) < self.BUFFER:
                return
            spans, held[:] = list(held), []
        else:
            spans = [span]

        def write() -> None:
            try:
                with b.ts.transaction():
                    for sp in spans:
                        b.ts.spans.record(sp)
            except Exception as e:  # tracing never breaks a turn
                log.warning("span not recorded", error=str(e))

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called from a worker thread: write here
            write()
            return
        # A commit (an fsync) never runs on the host's one event loop, which every tenant's turns share.
        fut = loop.run_in_executor(None, write)
        self._writes.add(fut)
        fut.add_done_callback(self._writes.discard)

    def flush(self, b: TurnBinding) -> None:
        """Write the spans held for ``b``'s turn, inside the caller's transaction; later spans are written at once."""
        for sp in self._held.pop(b.turn_id, []):
            b.ts.spans.record(sp)
        self._done(b.turn_id)
