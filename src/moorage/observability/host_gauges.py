"""Gauges an operator alerts on, read at each scrape: background loops that keep failing, this host's awake
instances against its limits, the fleet heartbeat's age, and the work waiting in the store (webhook deliveries
not yet made, turns not yet ended).

Labels are the code's own words (a loop's name, a status); never a tenant, agent or user.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moorage import log as moorage_log


class Loops(Collector):
    """Each background loop's failed rounds since its last one that worked (``moorage.log.FailingRounds``)."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        rounds = GaugeMetricFamily("moorage_background_failing_rounds",
                                   "A background loop's failed rounds in a row (0: its last round worked)",
                                   labels=["loop"])
        failing = GaugeMetricFamily("moorage_background_failing_seconds",
                                    "How long a background loop's rounds have kept failing (0: not failing)",
                                    labels=["loop"])
        now = time.time()
        by_loop: dict[str, tuple[int, float]] = {}
        for fr in list(moorage_log.LOOPS):
            n, s = fr.rounds, (now - fr._since if fr.rounds else 0.0)
            was = by_loop.get(fr.what, (0, 0.0))
            by_loop[fr.what] = (max(was[0], n), max(was[1], s))
        for loop, (n, s) in sorted(by_loop.items()):
            rounds.add_metric([loop], float(n))
            failing.add_metric([loop], s)
        yield rounds
        yield failing


class Capacity(Collector):
    """This host's awake instances (and their guest RAM) against its limits, and the fleet heartbeat's age."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def collect(self) -> Iterable[GaugeMetricFamily]:
        manager = getattr(self._runtime, "instances", None)
        if manager is None:
            return
        awake = manager.awake_instances()
        yield GaugeMetricFamily("moorage_awake_instances", "Instances awake on this host", value=float(len(awake)))
        yield GaugeMetricFamily("moorage_awake_ram_mib", "Guest RAM of the instances awake on this host",
                                value=float(sum(a.ram_mib for a in awake)))
        cap = manager.capacity
        yield GaugeMetricFamily("moorage_awake_instances_limit",
                                "Instances this host keeps awake at most (-1: no limit; past it the idlest sleep)",
                                value=float(cap.max_awake if cap.max_awake is not None else -1))
        yield GaugeMetricFamily("moorage_awake_ram_mib_limit", "Guest RAM this host gives awake instances at most "
                                "(-1: no limit)", value=float(cap.max_ram_mib if cap.max_ram_mib is not None else -1))
        fleet = getattr(manager, "fleet", None)
        if fleet is not None and getattr(fleet, "_beat_mono", None) is not None:
            yield GaugeMetricFamily("moorage_fleet_heartbeat_age_seconds",
                                    "Since this host's last heartbeat the store took (its leases lapse past the TTL)",
                                    value=time.monotonic() - fleet._beat_mono)
            yield GaugeMetricFamily("moorage_fleet_lease_ttl_seconds", "How long this host's leases last unrenewed",
                                    value=float(fleet.lease_ttl_s))


Backlog = dict[str, float]


def store_backlog(store: Any) -> Callable[[], Backlog]:
    """Work waiting in the store, summed over tenants (aggregates only: rows never leave the database)."""

    def count() -> Backlog:
        now = time.time()
        out = {"webhooks_pending": 0.0, "webhooks_retrying": 0.0, "webhooks_failed": 0.0, "webhooks_oldest": 0.0,
               "turns_pending": 0.0, "turns_running": 0.0, "turns_oldest_pending": 0.0,
               "async_queued": 0.0, "async_oldest_queued": 0.0}
        for ts in store.operator.tenants():
            for status, n, retrying, oldest in ts.read(
                    "SELECT status, COUNT(*), SUM(CASE WHEN attempts > 0 THEN 1 ELSE 0 END), MIN(created_at) "
                    "FROM webhook_deliveries WHERE status IN ('pending', 'failed') GROUP BY status"):
                if status == "pending":
                    out["webhooks_pending"] += int(n)
                    out["webhooks_retrying"] += int(retrying or 0)
                    out["webhooks_oldest"] = max(out["webhooks_oldest"], now - float(oldest))
                else:
                    out["webhooks_failed"] += int(n)
            for status, n, oldest in ts.read("SELECT status, COUNT(*), MIN(updated_at) FROM workflow_runs "
                                             "WHERE status IN ('pending', 'running') GROUP BY status"):
                out[f"turns_{status}"] += int(n)
                if status == "pending":
                    out["turns_oldest_pending"] = max(out["turns_oldest_pending"], now - float(oldest))
            # Async turns accepted whose run has not begun (waiting their turn, or retried after "not now").
            for n, oldest in ts.read("SELECT COUNT(*), MIN(e.created_at) FROM executions e LEFT JOIN workflow_runs r "
                                     "ON r.id = e.id WHERE e.announced IS NULL AND r.id IS NULL"):
                out["async_queued"] += int(n or 0)
                if n:
                    out["async_oldest_queued"] = max(out["async_oldest_queued"], now - float(oldest))
        return out

    return count


#: The backlog's gauges: (key, name, help).
_BACKLOG = (
    ("webhooks_pending", "moorage_webhook_deliveries_pending", "Webhook deliveries not yet made (sent or re-sent)"),
    ("webhooks_retrying", "moorage_webhook_deliveries_retrying",
     "Webhook deliveries not yet made whose receiver failed at least once"),
    ("webhooks_failed", "moorage_webhook_deliveries_failed",
     "Webhook deliveries given up on after their last attempt (kept until retention removes them)"),
    ("webhooks_oldest", "moorage_webhook_oldest_pending_seconds", "Age of the oldest webhook delivery not yet made"),
    ("turns_pending", "moorage_turns_pending", "Turns queued or waiting to run again (async turns, resumed runs)"),
    ("turns_running", "moorage_turns_running", "Turns running now, on any host"),
    ("turns_oldest_pending", "moorage_turn_oldest_pending_seconds", "Age of the oldest turn queued to run"),
    ("async_queued", "moorage_async_turns_queued",
     "Async turns accepted (202) whose run has not begun: waiting for their instance, or retried after a refusal"),
    ("async_oldest_queued", "moorage_async_turn_oldest_queued_seconds", "Age of the oldest async turn not begun"),
)


class StoreBacklog(Collector):
    """``store_backlog``, recounted at most every ``ttl_s`` by one scraper at a time (others get the last)."""

    def __init__(self, count: Callable[[], Backlog], ttl_s: float) -> None:
        self._count, self._ttl_s = count, ttl_s
        self._last: Backlog = {}
        self._at = float("-inf")
        self._lock = threading.Lock()
        self._up = True  # whether the last count reached the store

    def _current(self) -> Backlog:
        if time.monotonic() - self._at < self._ttl_s or not self._lock.acquire(blocking=False):
            return self._last
        try:
            try:
                self._last, self._up = self._count(), True
            except Exception:  # noqa: BLE001 - a scrape must not fail because the store is briefly unreachable
                self._up = False
            self._at = time.monotonic()
        finally:
            self._lock.release()
        return self._last

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Registration needs the names only: no count of the store at start-up (it would be cached for ttl_s).
        yield GaugeMetricFamily("moorage_store_up", "")
        for _, name, _ in _BACKLOG:
            yield GaugeMetricFamily(name, "")

    def collect(self) -> Iterable[GaugeMetricFamily]:
        last = self._current()
        yield GaugeMetricFamily("moorage_store_up", "1 when the last count of the store's backlog reached the store, "
                                "0 when it failed (the figures below are then the last ones read)",
                                value=1.0 if self._up else 0.0)
        for key, name, help_ in _BACKLOG:
            if key in last:
                yield GaugeMetricFamily(name, help_, value=last[key])
