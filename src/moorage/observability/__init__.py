"""Observability: per-tenant traces recorded in the store, Prometheus metrics, optional OTLP export.

Traces are tenant data (kept in the tenant's store); metrics are installation-wide and carry no tenant labels.
"""

from moorage.observability.metrics import Metrics
from moorage.observability.tracer import (
    SpanSink,
    Tracer,
    current_span_id,
    current_trace_id,
    new_span_id,
    new_trace_id,
    use_trace_id,
)

__all__ = ["Metrics", "SpanSink", "Tracer", "current_span_id", "current_trace_id", "new_span_id", "new_trace_id", "use_trace_id"]
