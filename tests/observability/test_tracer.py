"""The tracer on the real store (both backends): nesting, error status, tenant-scoped reads, OTLP copies."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moorage.errors import NotFound
from moorage.observability import Metrics, Tracer, current_trace_id, use_trace_id
from moorage.observability.otlp import OtelSink
from moorage.store import Scope, TenantStore


def test_nested_spans_share_a_trace_and_link_parents(tenant: TenantStore, other_tenant: TenantStore):
    tracer = Tracer()
    scope = Scope.session("helper", "alice", "s1")
    with tracer.span(tenant, "turn", scope=scope, **{"moorage.agent": "helper", "moorage.user": "alice"}) as turn:
        trace_id = current_trace_id()
        with tracer.span(tenant, "model.call", model="smollm2") as call:
            call.set(input_tokens=12)
        with pytest.raises(NotFound):
            with tracer.span(tenant, "tool.call", tool="search"):
                raise NotFound("no such page")
    spans = {s.name: s for s in tenant.spans.trace(trace_id)}
    assert set(spans) == {"turn", "model.call", "tool.call"}
    assert spans["model.call"].parent_id == turn.span_id == spans["tool.call"].parent_id
    assert spans["turn"].parent_id is None and spans["turn"].scope == scope
    assert spans["model.call"].attrs["input_tokens"] == 12
    assert spans["tool.call"].status == "error" and spans["tool.call"].attrs["error.code"] == "not-found"
    assert spans["turn"].attrs["moorage.tenant"] == tenant.tenant_id
    # Another tenant asking for the same trace id sees nothing.
    assert other_tenant.spans.trace(trace_id) == []
    assert current_trace_id() is None


def test_request_trace_id_is_inherited(tenant: TenantStore):
    tracer = Tracer()
    with use_trace_id("ab" * 16, "cd" * 8):
        with tracer.span(tenant, "sandbox.wake"):
            pass
    [span] = tenant.spans.trace("ab" * 16)
    assert span.parent_id == "cd" * 8


def test_otlp_sink_gets_a_copy(tenant: TenantStore):
    exporter = InMemorySpanExporter()
    tracer = Tracer(OtelSink(exporter))
    with tracer.span(tenant, "turn", **{"moorage.agent": "helper"}):
        with tracer.span(tenant, "model.call"):
            pass
    exported = {s.name: s for s in exporter.get_finished_spans()}
    assert set(exported) == {"turn", "model.call"}
    assert exported["model.call"].parent.span_id == exported["turn"].context.span_id
    assert exported["turn"].attributes["moorage.tenant"] == tenant.tenant_id
    assert exported["turn"].resource.attributes["service.name"] == "moorage"


def test_a_failing_sink_never_fails_the_work(tenant: TenantStore):
    class Broken:
        def export(self, tenant_id, span):
            raise RuntimeError("collector down")

    with Tracer(Broken()).span(tenant, "turn"):
        trace_id = current_trace_id()
    assert [s.name for s in tenant.spans.trace(trace_id)] == ["turn"]


def test_metrics_render_counts_without_tenant_labels():
    m = Metrics(lambda: {"running": 2, "sleeping": 5})
    m.observe_turn_outcome("done", "", 0.2, {"input_tokens": 30, "output_tokens": 7, "cost_usd": 0.1})
    m.observe_lifecycle("wake", "ok", 0.05, "snapshot")
    m.observe_error("not-found")
    text = m.render().decode()
    assert 'moorage_instances{state="sleeping"} 5.0' in text
    assert 'moorage_tokens_total{kind="input_tokens"} 30.0' in text
    assert 'moorage_turn_seconds_count{outcome="done"} 1.0' in text
    assert 'moorage_wake_seconds_count{kind="snapshot",outcome="ok"} 1.0' in text
    assert 'moorage_errors_total{code="not-found"} 1.0' in text
    assert "cost_usd" not in text


def test_an_error_code_moorage_does_not_define_is_counted_as_other():
    m = Metrics()
    m.observe_error("not-found")
    m.observe_error("x-invented-by-someone")
    m.observe_turn_outcome("failed", "also-invented", 0.1)
    text = m.render().decode()
    assert 'moorage_errors_total{code="not-found"} 1.0' in text
    assert 'moorage_errors_total{code="other"} 1.0' in text and "invented" not in text


def test_a_timed_step_that_raises_is_counted_as_failed_and_the_error_goes_on():
    from moorage.observability import events

    m = Metrics()
    with pytest.raises(OSError):
        with events.timed("checkpoint", "manual"):
            raise OSError("disk gone")
    with events.timed("checkpoint", "turn"):
        pass
    get = m.registry.get_sample_value
    assert get("moorage_checkpoint_seconds_count", {"outcome": "failed", "kind": "manual"}) == 1
    assert get("moorage_checkpoint_seconds_count", {"outcome": "ok", "kind": "turn"}) == 1


def test_a_turn_that_runs_to_its_timeout_falls_in_a_bucket_of_its_own():
    """Turns run up to 600 s (``turn_timeout_s``): one of 400 s is told from one of 130 s, not both over 2 min."""
    import moorage.runtime.turns  # noqa: F401 - where turn-timeout is defined (a host has it loaded)

    m = Metrics()
    m.observe_turn_outcome("done", "", 130.0)
    m.observe_turn_outcome("failed", "turn-timeout", 400.0)
    get = m.registry.get_sample_value
    assert get("moorage_turn_seconds_bucket", {"outcome": "done", "le": "300.0"}) == 1
    assert get("moorage_turn_seconds_bucket", {"outcome": "failed", "le": "300.0"}) == 0
    assert get("moorage_turn_seconds_bucket", {"outcome": "failed", "le": "600.0"}) == 1
    assert get("moorage_turn_failures_total", {"code": "turn-timeout"}) == 1
