"""Per-instance egress limits: open connections, connection rate, bandwidth and total bytes.

One ``Usage`` per awake instance (its gateway binding and its ``ctx.fetch`` calls share it); a
connection past a limit is refused before it is made, and bytes past the budget end the connection.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from moorage.errors import MoorageError


class EgressLimited(MoorageError):
    """This instance has reached one of its egress limits; the message says which."""

    code = "egress-limited"
    http_status = 429


@dataclass(frozen=True)
class Limits:
    max_connections: int = 32
    #: New connections per second (a burst of twice this is allowed).
    connects_per_s: float = 20.0
    #: Sustained bytes per second in both directions together (0: unlimited).
    bytes_per_s: int = 0
    #: Bytes over the life of one binding (one wake of an instance, or one fetch client), 0: unlimited.
    max_bytes: int = 1 << 30


class Usage:
    """The counters of one instance against its ``Limits``."""

    def __init__(self, limits: Limits, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.limits = limits
        self._clock = clock
        self.open = 0
        self.bytes = 0
        self._tokens = 2 * limits.connects_per_s
        self._last = clock()
        self._bw_tokens = float(limits.bytes_per_s)
        self._bw_last = clock()

    def _refill(self) -> None:
        now = self._clock()
        burst = 2 * self.limits.connects_per_s
        self._tokens = min(burst, self._tokens + (now - self._last) * self.limits.connects_per_s)
        self._last = now

    def admit(self) -> None:
        """Take one connection slot now, or raise ``EgressLimited``; pair with ``release()``."""
        self.reserve(0.0)

    def reserve(self, max_wait_s: float) -> float:
        """Take one connection slot and a place in the connection-rate queue; returns how long to wait before
        connecting (0 within the burst). Past the rate, connections are spaced out rather than refused (a
        ``pip install`` opens dozens in a row) until the wait would exceed ``max_wait_s``; past the open-connection
        limit or the byte budget it raises ``EgressLimited``. Pair with ``release()``."""
        if self.open >= self.limits.max_connections:
            raise EgressLimited(f"too many open egress connections (limit {self.limits.max_connections})",
                                hint="close connections you no longer need, or ask the operator for a higher limit")
        if self.limits.max_bytes and self.bytes >= self.limits.max_bytes:
            raise EgressLimited(f"egress byte budget of {self.limits.max_bytes} bytes used up for this instance",
                                hint="the budget renews when the instance wakes again")
        self._refill()
        # Tokens may go below zero: each waiter holds its place, so the rate holds however many wait at once.
        wait = max(0.0, (1 - self._tokens) / self.limits.connects_per_s)
        if wait > max_wait_s:
            raise EgressLimited(f"too many new egress connections (limit {self.limits.connects_per_s:g}/s)",
                                hint="retry after a short pause")
        self._tokens -= 1
        self.open += 1
        return wait

    def release(self) -> None:
        self.open = max(0, self.open - 1)

    async def spend(self, n: int) -> None:
        """Count ``n`` bytes; waits while over the bandwidth limit, raises once the byte budget is gone."""
        self.bytes += n
        if self.limits.max_bytes and self.bytes > self.limits.max_bytes:
            raise EgressLimited(f"egress byte budget of {self.limits.max_bytes} bytes used up for this instance")
        rate = self.limits.bytes_per_s
        if rate <= 0:
            return
        now = self._clock()
        self._bw_tokens = min(float(rate), self._bw_tokens + (now - self._bw_last) * rate)
        self._bw_last = now
        self._bw_tokens -= n
        if self._bw_tokens < 0:
            await asyncio.sleep(-self._bw_tokens / rate)
