"""Each tenant's share of the host's worker-thread CPU for the calls its guests make: metered, and enforced by
making the tenant's next call wait once it has used more than its share (its guest waits: backpressure).

The host is one Python process. Its event loop and its worker threads share one interpreter lock, so a guest that
keeps a worker busy with cheap calls (thousands a second, each well inside every concurrency cap) takes that lock
from the loop that serves every other tenant's turns. A concurrency cap bounds how many calls run, not how much
CPU they burn; this bounds the CPU. The work of a call runs on the loop's default executor (``asyncio.to_thread``),
which is replaced by a ``MeteredExecutor``: it charges each job's thread CPU time to the meter current in the
submitting task (``metered``), read when the job is submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

#: A tenant may run at full speed for this much CPU before its share applies.
BURST_S = 0.25
#: The longest one call waits for its share (then it runs): a tenant is slowed, never starved.
MAX_WAIT_S = 2.0

_current: contextvars.ContextVar["Meter | None"] = contextvars.ContextVar("moorage_cpu_meter", default=None)


class Meter:
    """CPU seconds one tenant's calls used, against a budget refilled at ``share`` cores."""

    def __init__(self, share: float, burst_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.burst_s = BURST_S if burst_s is None else burst_s
        self._clock = clock
        self._lock = threading.Lock()
        self._budget = self.burst_s
        self._mark = clock()
        self.used_s = 0.0  # all CPU charged so far (for tests and stats)
        self.waits = 0  # calls that waited for the share

    def charge(self, seconds: float) -> None:
        with self._lock:
            self._budget -= seconds
            self.used_s += seconds

    def wait_s(self) -> float:
        """How long the next call must wait for the budget to be back to zero (0: it runs now)."""
        with self._lock:
            now = self._clock()
            self._budget = min(self.burst_s, self._budget + (now - self._mark) * self.share)
            self._mark = now
            return -self._budget / self.share if self._budget < 0 else 0.0


class MeteredExecutor(ThreadPoolExecutor):
    """asyncio's default executor, charging each job's thread CPU time to the submitting task's meter."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        meter = _current.get()
        if meter is None:
            return super().submit(fn, *args, **kwargs)

        def run() -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                meter.charge(time.thread_time() - started)

        return super().submit(run)


_installed: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Make the loop's default executor a metered one (once per loop; asyncio's own size and thread names)."""
    if loop in _installed:
        return
    old = getattr(loop, "_default_executor", None)  # made by an earlier to_thread: its idle threads are let go
    loop.set_default_executor(MeteredExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4),
                                              thread_name_prefix="asyncio"))
    if old is not None:
        old.shutdown(wait=False)
    _installed.add(loop)


@contextlib.contextmanager
def metered(meter: Meter) -> Iterator[None]:
    """Work submitted to the default executor inside the block is charged to ``meter``."""
    token = _current.set(meter)
    try:
        yield
    finally:
        _current.reset(token)


async def wait_for_share(meter: Meter) -> float:
    """Wait until the meter's tenant is within its share again (at most MAX_WAIT_S); returns the seconds waited."""
    wait = min(meter.wait_s(), MAX_WAIT_S)
    if wait > 0:
        meter.waits += 1
        await asyncio.sleep(wait)
    return wait
