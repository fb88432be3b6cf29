"""The tracer: spans of requests, turns, model and tool calls, state changes and sandbox verbs.

Every span is written into the tenant's own store (``ts.spans``), so a trace is as isolated as the data
it describes; an optional ``SpanSink`` (e.g. OTLP) receives a copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

from moorage.errors import MoorageError
from moorage.log import get_logger
from moorage.store import Scope, Span, TenantStore

log = get_logger(__name__)

#: The trace and span the current task is working inside (set by the API for each request).
_current: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar("moorage_trace", default=None)


def new_trace_id() -> str:
    """A W3C-compatible trace id: 32 lowercase hex characters."""
    return secrets.token_hex(16)


def new_span_id() -> str:
    return secrets.token_hex(8)


def current_trace_id() -> str | None:
    cur = _current.get()
    return cur[0] if cur else None


def current_span_id() -> str | None:
    """The span the current task works inside (a request's span), the parent of spans it starts."""
    cur = _current.get()
    return cur[1] if cur else None


@contextlib.contextmanager
def use_trace_id(trace_id: str, span_id: str | None = None) -> Iterator[None]:
    """Make ``trace_id`` (and ``span_id`` as the parent) current for code called inside the block."""
    token = _current.set((trace_id, span_id))
    try:
        yield
    finally:
        _current.reset(token)


class SpanSink(Protocol):
    """Somewhere finished spans are also sent (an OTLP exporter). Must not raise into the caller."""

    def export(self, tenant_id: str, span: Span) -> None: ...


@dataclass
class ActiveSpan:
    """A span being timed; callers may add attributes or mark it failed before it ends."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ts: float
    attrs: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"

    def set(self, **attrs: Any) -> None:
        self.attrs.update({k: v for k, v in attrs.items() if v is not None})

    def fail(self, error: BaseException | str) -> None:
        self.status = "error"
        if isinstance(error, MoorageError):
            self.attrs["error.code"] = error.code
            self.attrs["error.message"] = error.message
        else:
            self.attrs["error.message"] = str(error) if isinstance(error, str) else type(error).__name__


def entity_attrs(tenant_id: str, agent: str | None = None, user: str | None = None,
                 session: str | None = None) -> dict[str, Any]:
    """The standard attribute names for who a span is about."""
    out: dict[str, Any] = {"moorage.tenant": tenant_id}
    for k, v in (("moorage.agent", agent), ("moorage.user", user), ("moorage.session", session)):
        if v is not None:
            out[k] = v
    return out


class Tracer:
    """Records spans into the tenant store of the principal that caused them."""

    def __init__(self, sink: SpanSink | None = None) -> None:
        self.sink = sink

    @contextlib.contextmanager
    def span(self, ts: TenantStore, name: str, *, scope: Scope | None = None, **attrs: Any) -> Iterator[ActiveSpan]:
        """Time the block as one span, child of the current span; nested ``span`` calls become its children."""
        cur = _current.get()
        trace_id = cur[0] if cur else new_trace_id()
        active = ActiveSpan(trace_id, new_span_id(), cur[1] if cur else None, name, time.time(),
                            {**entity_attrs(ts.tenant_id), **{k: v for k, v in attrs.items() if v is not None}})
        token = _current.set((trace_id, active.span_id))
        try:
            yield active
        except BaseException as e:
            active.fail(e)
            raise
        finally:
            _current.reset(token)
            self.finish(ts, active, scope=scope)

    def start(self, ts: TenantStore, name: str, *, trace_id: str | None = None, parent_id: str | None = None,
              **attrs: Any) -> ActiveSpan:
        """Begin a span whose end is recorded later with ``finish`` (for work that spans callbacks)."""
        cur = _current.get()
        return ActiveSpan(trace_id or (cur[0] if cur else new_trace_id()), new_span_id(),
                          parent_id if parent_id is not None else (cur[1] if cur else None), name, time.time(),
                          {**entity_attrs(ts.tenant_id), **{k: v for k, v in attrs.items() if v is not None}})

    def finish(self, ts: TenantStore, active: ActiveSpan, *, scope: Scope | None = None,
               end_ts: float | None = None) -> Span:
        span = Span(active.trace_id, active.span_id, active.parent_id, active.name, active.start_ts,
                    end_ts if end_ts is not None else time.time(), active.status, dict(active.attrs), scope)
        try:
            ts.spans.record(span)
        except Exception as e:  # noqa: BLE001 - tracing must never fail the work it describes
            log.warning("span not recorded", span=active.name, error=str(e))
        if self.sink is not None:
            try:
                self.sink.export(ts.tenant_id, span)
            except Exception as e:  # noqa: BLE001
                log.warning("span not exported", span=active.name, error=str(e))
        return span
