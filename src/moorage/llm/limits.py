"""Per-tenant admission control: token-bucket rate limits (requests and tokens) and token budgets.

State is in this process's memory; a fleet shares budgets through the usage ledger in the store.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from moorage.llm.errors import BudgetExceeded, RateLimited

Clock = Callable[[], float]


@dataclass(frozen=True)
class RateLimit:
    """Sustained ``per_minute`` with bursts of up to ``burst`` (defaults to one minute's worth)."""

    per_minute: float
    burst: float | None = None

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else self.per_minute


@dataclass(frozen=True)
class Budget:
    """At most ``tokens`` (input + output) per window of ``window_s`` seconds (None: ever)."""

    tokens: int
    window_s: float | None = None


class TokenBucket:
    """Refills continuously at ``rate`` per second up to ``capacity``; may go negative when a call
    turns out to have used more than was reserved, which delays the next call accordingly."""

    def __init__(self, limit: RateLimit, clock: Clock) -> None:
        self.capacity = limit.capacity
        self.rate = limit.per_minute / 60.0
        self._level = self.capacity
        self._clock = clock
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now)."""
        self._refill()
        need = min(amount, self.capacity) - self._level  # a request bigger than the bucket waits for a full one
        if need <= 0:
            return 0.0
        return need / self.rate if self.rate > 0 else math.inf

    def take(self, amount: float) -> None:
        self._refill()
        self._level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + amount)


@dataclass(frozen=True)
class TenantLimits:
    requests: RateLimit | None = None
    tokens: RateLimit | None = None
    budget: Budget | None = None


class _TenantState:
    def __init__(self, limits: TenantLimits, clock: Clock) -> None:
        self.limits = limits
        self.requests = TokenBucket(limits.requests, clock) if limits.requests else None
        self.tokens = TokenBucket(limits.tokens, clock) if limits.tokens else None
        self.used = 0
        self.window_start = clock()


class Admission:
    """Decides whether a tenant's call may start, and settles what it really used afterwards."""

    def __init__(self, limits: dict[str, TenantLimits] | None = None, *, default: TenantLimits = TenantLimits(), clock: Clock = time.monotonic) -> None:
        self._limits = dict(limits or {})
        self._default = default
        self._clock = clock
        self._state: dict[str, _TenantState] = {}
        self._lock = threading.Lock()

    def set_limits(self, tenant_id: str, limits: TenantLimits) -> None:
        with self._lock:
            self._limits[tenant_id] = limits
            self._state.pop(tenant_id, None)

    def _get(self, tenant_id: str) -> _TenantState:
        st = self._state.get(tenant_id)
        if st is None:
            st = self._state[tenant_id] = _TenantState(self._limits.get(tenant_id, self._default), self._clock)
        budget = st.limits.budget
        if budget and budget.window_s is not None and self._clock() - st.window_start >= budget.window_s:
            elapsed = self._clock() - st.window_start
            st.window_start += budget.window_s * math.floor(elapsed / budget.window_s)
            st.used = 0
        return st

    def admit(self, tenant_id: str, estimated_tokens: int) -> None:
        """Reserve one request and ``estimated_tokens``, or raise ``BudgetExceeded`` / ``RateLimited``."""
        with self._lock:
            st = self._get(tenant_id)
            budget = st.limits.budget
            if budget is not None and st.used + estimated_tokens > budget.tokens:
                resets_in = None if budget.window_s is None else budget.window_s - (self._clock() - st.window_start)
                when = "it does not reset" if resets_in is None else f"it resets in {resets_in:.0f} s"
                raise BudgetExceeded(
                    f"tenant {tenant_id!r} has used {st.used} of its {budget.tokens}-token budget; this call needs about "
                    f"{estimated_tokens} more ({when})",
                    tenant_id=tenant_id, limit=budget.tokens, used=st.used, resets_in=resets_in,
                    hint=("raise the tenant's budget, shorten the prompt, or wait for the budget window to reset"
                          if resets_in is not None else
                          "raise the tenant's token budget (this budget never resets, so asking again is refused "
                          "the same way until it is raised)"),
                )
            waits = []
            if st.requests is not None:
                waits.append(("requests", st.requests.wait_for(1)))
            if st.tokens is not None:
                waits.append(("tokens", st.tokens.wait_for(estimated_tokens)))
            blocked = [(what, w) for what, w in waits if w > 0]
            if blocked:
                what, wait = max(blocked, key=lambda x: x[1])
                raise RateLimited(
                    f"tenant {tenant_id!r} is over its per-minute {what} limit",
                    retry_after=wait, scope="tenant", status=None,
                )
            if st.requests is not None:
                st.requests.take(1)
            if st.tokens is not None:
                st.tokens.take(estimated_tokens)
            st.used += estimated_tokens

    def settle(self, tenant_id: str, estimated_tokens: int, actual_tokens: int) -> None:
        """Replace the reservation with what the provider reported (0 when the call failed)."""
        with self._lock:
            st = self._get(tenant_id)
            st.used = max(0, st.used - estimated_tokens + actual_tokens)
            if st.tokens is not None:
                diff = actual_tokens - estimated_tokens
                if diff > 0:
                    st.tokens.take(diff)
                else:
                    st.tokens.give_back(-diff)

    def used(self, tenant_id: str) -> int:
        with self._lock:
            return self._get(tenant_id).used
