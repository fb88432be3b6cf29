"""Prometheus metrics of one moorage process: requests, errors, turns by outcome, wake, fork, sleep and checkpoint
latency, tokens, instances, the data disk's free space, the clock offset, and what ``host_gauges`` reads (failing
background loops, awake instances against the limits, the store's backlog). docs/operations.md lists them all.

Labels are route templates, known methods, error codes, states, outcomes and loop names only: never tenant ids, agent names, users
or secrets, because ``/metrics`` is scraped by the operator's monitoring, outside any tenant boundary. Every
label has a bounded set of values, so no client can grow the series count.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from moorage import clock
from moorage.observability import events, host_gauges
from moorage.observability.events import bounded_code

#: Latency buckets from 1 ms to 10 min: wakes are tens of ms, turns with a model can take a minute, and a turn
#: may run up to its timeout (``MAX_TURN_TIMEOUT_S``, 600 s) before it is stopped.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            300.0, 600.0)

#: Methods that get their own label; any other (a client may invent one per request) is counted as "other".
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: The instance gauge is recounted at most this often, however often (or by how many) it is scraped.
INSTANCE_COUNT_TTL_S = 15.0

#: Usage keys counted as tokens (a turn's, ``runtime/host_calls.py``); no other key becomes a label.
TOKEN_KINDS = frozenset({"input_tokens", "output_tokens"})

InstanceCounter = Callable[[], Mapping[str, int]]


class _Instances(Collector):
    """Sandbox counts by state, recounted at most every ``ttl_s`` by one scraper at a time (others get the last)."""

    def __init__(self, count: InstanceCounter, ttl_s: float = INSTANCE_COUNT_TTL_S) -> None:
        self._count = count
        self._ttl_s = ttl_s
        self._counts: Mapping[str, int] = {}
        self._at = float("-inf")
        self._lock = threading.Lock()

    def _current(self) -> Mapping[str, int]:
        if time.monotonic() - self._at < self._ttl_s or not self._lock.acquire(blocking=False):
            return self._counts
        try:
            try:
                self._counts = dict(self._count())
            except Exception:  # noqa: BLE001 - a scrape must not fail because the store is briefly unreachable
                pass
            self._at = time.monotonic()
        finally:
            self._lock.release()
        return self._counts

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("moorage_instances", "Agent sandboxes by lifecycle state", labels=["state"])

    def describe(self) -> Iterable[GaugeMetricFamily]:
        yield self._family()  # registration needs the name only: no count at start-up

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = self._family()
        for state, n in sorted(self._current().items()):
            g.add_metric([state], float(n))
        yield g


class _DataDisk(Collector):
    """The data directory's disk, read at each scrape (one ``statvfs``)."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def collect(self) -> Iterable[GaugeMetricFamily]:
        from moorage.observability.disk import disk_space

        try:
            space = disk_space(self._path)
        except OSError:
            return
        yield GaugeMetricFamily("moorage_data_disk_size_bytes", "Size of the data directory's filesystem",
                                value=float(space.size))
        yield GaugeMetricFamily("moorage_data_disk_free_bytes",
                                "Free space on the data directory's filesystem (writes are refused once it is 0)",
                                value=float(space.free))


class _ClockOffset(Collector):
    """How far the store's clock is from this host's (``moorage.clock``): leases and claims run on the store's."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily("moorage_clock_offset_seconds",
                                "The store's clock minus this host's, as last measured (0 with a store on this host)",
                                value=clock.offset())


class _WithoutCreated(Collector):
    """A registry as ``/metrics`` shows it: without prometheus_client's ``_created`` series (when each counter's and
    histogram's labels were first used), which no alert reads and which about doubled the series of a scrape.
    Dropped here, for moorage's registry only: ``disable_created_metrics()`` would drop them for every other user of
    prometheus_client in the process too (an application that embeds moorage)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Any]:
        for family in self._registry.collect():  # families are built anew at each collect: ours to change
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


class Metrics:
    """One registry per app, so several apps (tests, embedded use) never share or collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, instances: InstanceCounter | None = None, *, instance_ttl_s: float = INSTANCE_COUNT_TTL_S,
                 data_dir: Path | None = None, runtime: Any = None,
                 backlog: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("moorage_http_requests", "HTTP requests served", ["method", "route", "status"], registry=r)
        self.errors = Counter("moorage_errors", "Errors returned, by problem type", ["code"], registry=r)
        self.turn_seconds = Histogram("moorage_turn_seconds", "Agent turn latency, by how the turn ended "
                                      "(done, failed, waiting, cancelled)", ["outcome"], buckets=_BUCKETS, registry=r)
        self.turn_failures = Counter("moorage_turn_failures", "Failed turns, by the failure's problem code",
                                     ["code"], registry=r)
        self.lifecycle_seconds = {
            op: Histogram(f"moorage_{op}_seconds", help_, labels, buckets=_BUCKETS, registry=r)
            for op, help_, labels in (
                ("wake", "Sandbox wake latency (a sleeping instance brought back), by outcome and how it came up",
                 ["outcome", "kind"]),
                ("fork", "New instance latency (forked from its agent's template), by outcome and how it came up",
                 ["outcome", "kind"]),
                ("sleep", "Sandbox sleep latency (snapshot written, instance recorded asleep), by outcome",
                 ["outcome"]),
                ("checkpoint", "Checkpoint latency (the sandbox half), by outcome and kind", ["outcome", "kind"]))}
        self.unreachable = Counter("moorage_unreachable", "Calls to the store (PostgreSQL) or the object store that "
                                   "failed because it could not be reached", ["backend"], registry=r)
        for backend in ("store", "object-store"):
            self.unreachable.labels(backend)  # both shown from the start, at 0
        self.tokens = Counter("moorage_tokens", "Model tokens used by turns", ["kind"], registry=r)
        if instances is not None:
            r.register(_Instances(instances, instance_ttl_s))
        if data_dir is not None:
            r.register(_DataDisk(data_dir))
        r.register(_ClockOffset())
        r.register(host_gauges.Loops())
        if runtime is not None:
            r.register(host_gauges.Capacity(runtime))
        if backlog is not None:
            r.register(host_gauges.StoreBacklog(backlog, instance_ttl_s))
        events.subscribe(self)  # the runtime's wakes, sleeps, checkpoints and turns

    def observe_request(self, method: str, route: str, status: int) -> None:
        self.requests.labels(method if method in KNOWN_METHODS else "other", route, str(status)).inc()

    def observe_error(self, code: str) -> None:
        self.errors.labels(bounded_code(code)).inc()

    def observe_turn_outcome(self, outcome: str, code: str, seconds: float,
                             usage: Mapping[str, float] | None = None) -> None:
        """A turn ended (``events.turn_ended``): its latency by outcome, its failure's code, its tokens."""
        self.turn_seconds.labels(outcome).observe(seconds)
        if outcome == "failed":
            self.turn_failures.labels(bounded_code(code or "internal")).inc()
        for kind, amount in (usage or {}).items():
            if isinstance(amount, (int, float)) and amount > 0 and kind in TOKEN_KINDS:
                self.tokens.labels(kind).inc(amount)

    def observe_lifecycle(self, op: str, outcome: str, seconds: float, kind: str = "") -> None:
        """A wake, fork, sleep or checkpoint ended (``events.lifecycle``)."""
        h = self.lifecycle_seconds.get(op)
        if h is not None:
            (h.labels(outcome) if op == "sleep" else h.labels(outcome, kind or "none")).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))
