"""Where the runtime reports what it did, for the metrics of every app of this process (``Metrics``).

The lifecycle and the turn path call these with one line each (``lifecycle``, ``timed``, ``turn_ended``); they
reach every live ``Metrics`` (one per app; ``moorage up`` has one). Reporting never fails what is reported on.
Every label value passed here is bounded: operations, outcomes and kinds are the code's own words, error codes
are folded to the ones moorage defines (``bounded_code``).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Iterator, Mapping

from moorage.log import get_logger

log = get_logger(__name__)

#: The lifecycle operations that have a latency histogram (``moorage_<op>_seconds``).
LIFECYCLE_OPS = ("wake", "fork", "sleep", "checkpoint")

_sinks: "weakref.WeakSet[Any]" = weakref.WeakSet()


def subscribe(metrics: Any) -> None:
    """``metrics`` (a ``Metrics``) gets every report from now on, for as long as it lives."""
    _sinks.add(metrics)


def lifecycle(op: str, outcome: str, started_wall: float, kind: str = "") -> None:
    """``op`` (one of ``LIFECYCLE_OPS``) ended with ``outcome`` (ok, failed, no-capacity); ``started_wall``:
    its ``time.time()`` at the start. ``kind``: how it came up (a wake's or fork's ``WakeKind``, a checkpoint's)."""
    seconds = max(0.0, time.time() - started_wall)
    for m in list(_sinks):
        try:
            m.observe_lifecycle(op, outcome, seconds, kind)
        except Exception as e:  # noqa: BLE001 - metrics never fail a wake
            log.warning("a lifecycle metric was not recorded", op=op, error=str(e))


@contextlib.contextmanager
def timed(op: str, kind: str = "") -> Iterator[None]:
    """``lifecycle`` for a block: ``ok`` when it ends, ``failed`` when it raises (and the error goes on)."""
    started = time.time()
    try:
        yield
    except BaseException:
        lifecycle(op, "failed", started, kind)
        raise
    lifecycle(op, "ok", started, kind)


def turn_ended(status: str, seconds: float, attrs: Mapping[str, Any], usage: Mapping[str, Any] | None) -> None:
    """A turn's span ended with ``status`` (done, error, waiting, cancelled; ``attrs``: the span's, with the
    failure's ``error.code``); ``usage``: its model usage (tokens) when it is done."""
    outcome = {"done": "done", "error": "failed", "waiting": "waiting", "cancelled": "cancelled"}.get(status, "other")
    code = bounded_code(str(attrs.get("error.code") or ("internal" if outcome == "failed" else "")))
    for m in list(_sinks):
        try:
            m.observe_turn_outcome(outcome, code, seconds, usage if outcome == "done" else None)
        except Exception as e:  # noqa: BLE001 - metrics never fail a turn
            log.warning("a turn metric was not recorded", error=str(e))


def unreachable(backend: str) -> None:
    """A call to ``backend`` (``store``: PostgreSQL; ``object-store``) failed because it could not be reached."""
    for m in list(_sinks):
        with contextlib.suppress(Exception):  # metrics never fail what failed already
            m.unreachable.labels(backend).inc()


#: Problem codes the API answers with that are no ``MoorageError`` class's (``api/app.py``, ``api/middleware.py``)
#: or that one error class sets per instance (``TurnLimited``: the limit's kind).
_EXTRA_CODES = frozenset({"", "internal", "no-route", "method-not-allowed", "http", "payload-too-large",
                          "rate-limited", "budget-exceeded"})
_known: set[str] = set()


def _class_codes() -> set[str]:
    from moorage.errors import MoorageError

    out, todo = set(), [MoorageError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        code = cls.__dict__.get("code")
        if isinstance(code, str):
            out.add(code)
    return out


def bounded_code(code: str) -> str:
    """``code`` if moorage defines it (an error class's, or one of ``_EXTRA_CODES``), else ``other``: a label
    whose values nobody outside the code can add to."""
    if code in _EXTRA_CODES or code in _known:
        return code
    _known.update(_class_codes())  # classes of modules imported since the last look
    return code if code in _known else "other"
