"""Which tenants are running turns on this host, now or a moment ago: a tenant's CPU share applies only while
another tenant is (runtime/cpu_share.py), so a tenant alone on a host is never held back.

"A moment ago" matters: a neighbour taking turns back to back has no turn running between two of them, and an
attacker let go at full speed in those gaps still has its calls in flight when the next turn starts.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

#: A tenant whose last turn ended this recently still counts as active.
RECENT_S = 1.0


class TenantActivity:
    def __init__(self, clock: Callable[[], float] = time.monotonic, recent_s: float = RECENT_S) -> None:
        self._clock = clock
        self._recent_s = recent_s
        self._running = collections.Counter[str]()
        self._total = 0
        #: The two tenants whose turns ended last, newest first, as (tenant, when): enough to say whether any
        #: tenant other than a given one ended a turn recently, in constant time.
        self._last: list[tuple[str, float]] = []

    def begin(self, tenant_id: str) -> None:
        self._running[tenant_id] += 1
        self._total += 1

    def end(self, tenant_id: str) -> None:
        self._running[tenant_id] -= 1
        self._total -= 1
        if not self._running[tenant_id]:
            del self._running[tenant_id]
        self._last = [(tenant_id, self._clock()), *[e for e in self._last if e[0] != tenant_id]][:2]

    def running(self, tenant_id: str | None = None) -> int:
        """Turns running now (of one tenant, or of all)."""
        return self._total if tenant_id is None else self._running[tenant_id]

    def others_active(self, tenant_id: str) -> bool:
        """Whether a tenant other than ``tenant_id`` has a turn running or ended one within ``recent_s``."""
        if self._total > self._running[tenant_id]:
            return True
        since = self._clock() - self._recent_s
        return any(t != tenant_id and at >= since for t, at in self._last)
