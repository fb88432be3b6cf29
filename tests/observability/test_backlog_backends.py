"""The store backlog ``/metrics`` shows is counted with SQL that both store backends (SQLite, PostgreSQL) run,
summed over tenants."""

from __future__ import annotations

import time

from moorage.observability.host_gauges import store_backlog
from moorage.store import Store


def test_the_backlog_is_counted_on_both_backends(store: Store) -> None:
    assert set(store_backlog(store)().values()) == {0.0}
    for name in ("acme", "globex"):
        ts = store.tenant(store.authenticate(store.operator.create_tenant(name)[1].secret))
        ts.webhooks.create("echo", "https://example.com/hooks")
        first, second = ts.deliveries.enqueue("echo", "execution.succeeded", {"n": 1}) + \
            ts.deliveries.enqueue("echo", "execution.succeeded", {"n": 2})
        now = time.time()
        ts.deliveries.record_attempt(first, at=now, status_code=503, error=None, duration_ms=1.0, delivered=False,
                                     retry_at=now + 60)
        ts.deliveries.record_attempt(second, at=now, status_code=503, error=None, duration_ms=1.0, delivered=False,
                                     retry_at=None)  # given up on
        ts.executions.create(f"ex-{name}", "echo", "ada", "default", {"message": "hi"})  # accepted, no run yet
    got = store_backlog(store)()
    assert got["webhooks_pending"] == 2 and got["webhooks_retrying"] == 2 and got["webhooks_failed"] == 2, got
    assert got["async_queued"] == 2 and got["async_oldest_queued"] >= 0, got
    assert got["webhooks_oldest"] >= 0 and got["turns_pending"] == 0 and got["turns_running"] == 0, got
