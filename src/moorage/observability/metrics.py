"""Prometheus metrics of one moorage process: requests, errors, turn and wake latency, tokens, instances.

Labels are route templates, error codes and states only: never tenant ids, agent names, users or secrets,
because ``/metrics`` is scraped by the operator's monitoring, outside any tenant boundary.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

#: Latency buckets from 1 ms to 2 min: wakes are tens of ms, turns with a model can take a minute.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

InstanceCounter = Callable[[], Mapping[str, int]]


class _Instances(Collector):
    """Asks for sandbox counts by state at scrape time, so the gauge is never stale."""

    def __init__(self, count: InstanceCounter) -> None:
        self._count = count

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("moorage_instances", "Agent sandboxes by lifecycle state", labels=["state"])
        try:
            counts = self._count()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the store is briefly unreachable
            counts = {}
        for state, n in sorted(counts.items()):
            g.add_metric([state], float(n))
        yield g


class Metrics:
    """One registry per app, so several apps (tests, embedded use) never share or collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, instances: InstanceCounter | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("moorage_http_requests", "HTTP requests served", ["method", "route", "status"], registry=r)
        self.errors = Counter("moorage_errors", "Errors returned, by problem type", ["code"], registry=r)
        self.turn_seconds = Histogram("moorage_turn_seconds", "Agent turn latency", buckets=_BUCKETS, registry=r)
        self.wake_seconds = Histogram("moorage_wake_seconds", "Sandbox wake latency", buckets=_BUCKETS, registry=r)
        self.tokens = Counter("moorage_tokens", "Model tokens used by turns", ["kind"], registry=r)
        if instances is not None:
            r.register(_Instances(instances))

    def observe_request(self, method: str, route: str, status: int) -> None:
        self.requests.labels(method, route, str(status)).inc()

    def observe_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def observe_turn(self, seconds: float, usage: Mapping[str, float] | None = None) -> None:
        self.turn_seconds.observe(seconds)
        for kind, amount in (usage or {}).items():
            if isinstance(amount, (int, float)) and amount > 0 and kind.endswith("tokens"):
                self.tokens.labels(kind).inc(amount)

    def observe_wake(self, seconds: float) -> None:
        self.wake_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
