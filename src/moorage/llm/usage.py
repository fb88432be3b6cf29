"""Per-call accounting: the ``UsageSink`` protocol the gateway reports every finished call to.

The store plugs its usage ledger and traces in here; ``InMemoryUsageSink`` serves tests and single processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Mapping, Protocol


@dataclass(frozen=True)
class UsageRecord:
    tenant_id: str
    entity: Mapping[str, str]
    provider: str
    model: str
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cost_usd: float
    latency_ms: float
    trace_id: str | None


class UsageSink(Protocol):
    def record(
        self,
        *,
        tenant_id: str,
        entity: Mapping[str, str],
        provider: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int,
        cost_usd: float,
        latency_ms: float,
        trace_id: str | None,
    ) -> None | Awaitable[None]:
        """Store one finished call. May be sync or async; the gateway awaits a returned awaitable."""
        ...


@dataclass
class InMemoryUsageSink:
    records: list[UsageRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, **fields: Any) -> None:
        with self._lock:
            self.records.append(UsageRecord(**fields))

    def for_tenant(self, tenant_id: str) -> list[UsageRecord]:
        with self._lock:
            return [r for r in self.records if r.tenant_id == tenant_id]

    def totals(self, tenant_id: str) -> dict[str, float]:
        rs = self.for_tenant(tenant_id)
        return {
            "calls": len(rs),
            "input_tokens": sum(r.input_tokens for r in rs),
            "output_tokens": sum(r.output_tokens for r in rs),
            "cached_input_tokens": sum(r.cached_input_tokens for r in rs),
            "cost_usd": sum(r.cost_usd for r in rs),
        }
