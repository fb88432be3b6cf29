"""Each tenant's share of the host's CPU for what its guests make the host do: metered, and enforced by the
channel, which stops reading a guest's frames while its tenant has used more than its share and other tenants run
turns (the guest waits: backpressure; sandbox/channel_share.py, runtime/activity.py).

The host is one Python process. Its event loop and its worker threads share one interpreter lock, so a guest that
keeps a worker busy with cheap calls (thousands a second, each well inside every concurrency cap) takes that lock
from the loop that serves every other tenant's turns. A concurrency cap bounds how many calls run, not how much
CPU they burn; this bounds the CPU. The work of a call runs on the loop's default executor (``asyncio.to_thread``),
which is replaced by a ``MeteredExecutor``: it charges each job's thread CPU time to the meter current in the
submitting task (``metered``), read when the job is submitted. The call's own steps on the event loop, and the
decoding of every frame the guest sends, are charged by the channel to the same meter.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

from moorage.cpus import usable_cpus

#: A tenant may run at full speed for this much CPU before its share applies.
BURST_S = 0.25

_current: contextvars.ContextVar["Meter | None"] = contextvars.ContextVar("moorage_cpu_meter", default=None)


class Meter:
    """CPU seconds one tenant's calls used, against a budget refilled at ``share`` cores.

    With ``contended``, the share applies only while it returns true (another tenant runs turns: runtime/activity.py):
    a tenant alone on the host is never held back, and what it overspent alone is forgiven when the others come back."""

    def __init__(self, share: float, burst_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 contended: Callable[[], bool] | None = None) -> None:
        self.share = share
        self.burst_s = BURST_S if burst_s is None else burst_s
        self.contended = contended
        self._clock = clock
        self._lock = threading.Lock()
        self._budget = self.burst_s
        self._mark = clock()
        self.used_s = 0.0  # all CPU charged so far (for tests and stats)
        self.waits = 0  # times a reader found the share spent and waited

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
            if self._budget < 0 and self.contended is not None and not self.contended():
                self._budget = 0.0
            if self._budget >= 0:
                return 0.0
            self.waits += 1
            return -self._budget / self.share


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


def executor_workers() -> int:
    """The default executor's threads: asyncio's own rule (CPUs + 4, at most 32), with the CPUs this process may
    use (``moorage.cpus``: a container's quota narrows them), not the machine's."""
    return min(32, usable_cpus() + 4)


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Make the loop's default executor a metered one (once per loop; asyncio's own size and thread names)."""
    if loop in _installed:
        return
    old = getattr(loop, "_default_executor", None)  # made by an earlier to_thread: its idle threads are let go
    loop.set_default_executor(MeteredExecutor(max_workers=executor_workers(), thread_name_prefix="asyncio"))
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
