"""``/metrics`` shows no ``_created`` series (prometheus_client's time each counter's and histogram's labels were
first used): nothing alerts on them and they about doubled a scrape's series. Only moorage's registry drops them:
another user of prometheus_client in the same process keeps its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moorage.observability.metrics import Metrics


def test_moorage_metrics_show_no_created_series_and_leave_other_registries_theirs() -> None:
    m = Metrics()
    m.observe_request("GET", "/v1/agents", 200)
    m.observe_error("not-found")
    m.observe_turn_outcome("failed", "agent-error", 0.2, {"input_tokens": 10})
    m.observe_lifecycle("wake", "ok", 0.05, "snapshot")
    text = m.render().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert "_created" not in text
    # What an alert reads is all still there.
    names = {s.name for s in samples}
    assert {"moorage_http_requests_total", "moorage_errors_total", "moorage_turn_failures_total",
            "moorage_tokens_total", "moorage_turn_seconds_bucket", "moorage_turn_seconds_count",
            "moorage_wake_seconds_sum"} <= names
    # An embedding application's own registry (and the process-wide switch) are left as they were.
    theirs = CollectorRegistry()
    Counter("app_jobs", "jobs", registry=theirs).inc()
    assert "app_jobs_created" in generate_latest(theirs).decode()
