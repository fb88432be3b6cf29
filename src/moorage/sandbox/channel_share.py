"""A channel's share of the host: the CPU its guest makes the host's event loop spend, charged to a budget.

Worker-thread time of a guest's calls is metered where the work is submitted (runtime/cpu_share.py). The rest of
what a guest costs runs on the host's one event loop: decoding its frames, dispatching them, the handlers' own
steps between their awaits, encoding and writing the answers. A guest that floods cheap calls spends mostly that,
and the loop is what every other tenant's turn waits on. A channel given a ``Share`` charges all of it, measured as
loop-thread CPU time, and stops reading the guest's frames while the share is overspent: the guest's writes then
wait in its own socket buffer, and the host spends nothing on them meanwhile.
"""

from __future__ import annotations

import time
from typing import Any, Coroutine, Generator, Protocol, TypeVar

T = TypeVar("T")

#: The longest a reader waits for its share before it reads the next frame: a guest is slowed, never starved.
MAX_WAIT_S = 2.0


class Share(Protocol):
    """A CPU budget (``runtime.cpu_share.Meter`` is one): ``charge`` spends, ``wait_s`` says how long until the
    budget is back to zero (0: within the share)."""

    def charge(self, seconds: float) -> None: ...

    def wait_s(self) -> float: ...


class Charged:
    """Await ``coro``, charging the loop-thread CPU time of each of its steps to ``share`` (time spent suspended
    is not charged: only the work done between awaits)."""

    __slots__ = ("_coro", "_share")

    def __init__(self, coro: Coroutine[Any, Any, T], share: Share) -> None:
        self._coro = coro
        self._share = share

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, charge, clock = self._coro, self._share.charge, time.thread_time
        value: Any = None
        error: BaseException | None = None
        while True:
            started = clock()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except BaseException as e:
                charge(clock() - started)
                if isinstance(e, StopIteration):
                    return e.value
                raise
            charge(clock() - started)
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # cancellation (and close) goes on into the coroutine
                value, error = None, e
