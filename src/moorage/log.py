"""Structured logging: one JSON object per line (or readable key=value for a terminal).

Every module logs through ``get_logger(__name__)`` and passes context as keyword fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import weakref
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(
            f"{k}={v}" for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")
        )
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        text = f"{base} {fields}" if fields else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Adapter(logging.LoggerAdapter):
    """Lets callers write ``log.info("woke", sandbox=sid, ms=42)``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("exc_info", "stack_info", "stacklevel", "extra")}
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **extra}
        return msg, kwargs


def get_logger(name: str) -> _Adapter:
    return _Adapter(logging.getLogger(name), {})


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record is emitted, not as it was at ``configure``: a command run
    in-process with its streams swapped for a while (a test's runner) leaves no handler on a closed stream."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(level: str = "info", fmt: str = "text") -> None:
    """Configure the root ``moorage`` logger once, at process start."""
    handler = _StderrHandler()
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger("moorage")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


#: Every live ``FailingRounds``: ``/metrics`` shows each loop's failed rounds (``observability/host_gauges.py``).
LOOPS: "weakref.WeakSet[FailingRounds]" = weakref.WeakSet()

#: While a background loop's rounds keep failing, at most one line per this many seconds says so.
STILL_FAILING_EVERY_S = 60.0


class FailingRounds:
    """What one background loop logs about its failed rounds: the first failure, then at most one line a minute
    while they keep failing ("still failing: N rounds since HH:MM: reason"), then one line once a round works
    again. A ten-minute store outage is a dozen lines per loop, not one per round. Only a call to the store that
    worked, and began after the last failure, ends the failed rounds: a round that called nothing (nothing to
    send) is no sign the store is back, and neither is a call begun before a failure that was seen meanwhile."""

    def __init__(self, log: Any, what: str, *, level: int = logging.ERROR,
                 clock: Any = time.monotonic) -> None:
        self.log = log
        self.what = what
        self.level = level
        self.clock = clock
        #: Failed rounds since the last one that worked.
        self.rounds = 0
        self._since = 0.0  # wall time of the first of them
        self._said = 0.0  # monotonic time of the last line
        self._failed_at = float("-inf")  # monotonic time of the last failure
        LOOPS.add(self)

    def failed(self, e: BaseException, **fields: Any) -> None:
        """One round failed with ``e``."""
        self.rounds += 1
        now = self._failed_at = self.clock()
        if self.rounds == 1:
            self._since, self._said = time.time(), now
            self.log.log(self.level, f"{self.what} failed", error=str(e), **fields)
        elif now - self._said >= STILL_FAILING_EVERY_S:
            self._said = now
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.log.log(self.level, f"{self.what} still failing: {self.rounds} rounds since {self._hhmm()}: {reason}",
                         rounds=self.rounds, error=str(e), **fields)

    def ok(self, began: float | None = None) -> None:
        """One round's call to the store worked (``began``: when that call started, on this object's clock): says
        so once if the rounds before it failed. Call it only for a round that reached the store."""
        if began is not None and began < self._failed_at:
            return  # it started before a call that failed: the store may have gone down since
        if self.rounds:
            self.log.info(f"{self.what} works again after {self.rounds} failed rounds since {self._hhmm()}",
                          rounds=self.rounds)
            self.rounds = 0

    def _hhmm(self) -> str:
        return time.strftime("%H:%M UTC", time.gmtime(self._since))
