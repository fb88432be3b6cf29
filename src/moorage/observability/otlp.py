"""Optional OTLP export: a ``SpanSink`` that hands moorage spans to an OpenTelemetry SDK span exporter.

Needs ``opentelemetry-sdk``; nothing requires a collector: without an exporter configured no sink exists.
"""

from __future__ import annotations

from typing import Any

from moorage.errors import ConfigError
from moorage.store import Span


class OtelSink:
    """Converts each finished span to an SDK ``ReadableSpan`` and exports it (synchronously, one at a time)."""

    def __init__(self, exporter: Any, service_name: str = "moorage", *, batch: bool = False) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
        except ImportError as e:  # pragma: no cover - depends on the installation
            raise ConfigError("OTLP export needs opentelemetry-sdk", hint="pip install opentelemetry-sdk") from e
        self.exporter = exporter
        self.resource = Resource.create({"service.name": service_name})
        #: With ``batch``, spans are queued and sent by the SDK's background thread, so a slow or absent
        #: collector never holds up the request whose span it is.
        self.processor: Any = None
        if batch:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.processor = BatchSpanProcessor(exporter)

    def export(self, tenant_id: str, span: Span) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        ctx = SpanContext(int(span.trace_id, 16), int(span.span_id, 16), is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
        parent = (SpanContext(int(span.trace_id, 16), int(span.parent_id, 16), is_remote=False)
                  if span.parent_id else None)
        attrs = {k: v if isinstance(v, (str, bool, int, float)) else str(v) for k, v in span.attrs.items()}
        attrs["moorage.tenant"] = tenant_id
        if span.scope is not None:
            attrs["moorage.scope"] = span.scope.key
        readable = ReadableSpan(
            name=span.name, context=ctx, parent=parent, resource=self.resource, attributes=attrs,
            kind=SpanKind.SERVER if span.parent_id is None else SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR if span.status == "error" else StatusCode.OK),
            start_time=int(span.start_ts * 1e9), end_time=int((span.end_ts or span.start_ts) * 1e9),
        )
        if self.processor is not None:
            self.processor.on_end(readable)
        else:
            self.exporter.export([readable])

    def close(self) -> None:
        """Send what is queued, then stop the exporter."""
        if self.processor is not None:
            self.processor.shutdown()  # flushes the queue, then shuts the exporter down
        else:
            self.exporter.shutdown()


def otlp_sink(endpoint: str) -> OtelSink:
    """An OTLP/HTTP sink for ``endpoint`` (needs ``opentelemetry-exporter-otlp-proto-http``)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ConfigError("OTLP export needs the OTLP exporter",
                          hint="pip install opentelemetry-exporter-otlp-proto-http, or leave the endpoint empty") from e
    return OtelSink(OTLPSpanExporter(endpoint=endpoint), batch=True)
