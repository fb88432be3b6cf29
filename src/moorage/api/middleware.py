"""The outermost request layer: a trace id per request (``X-Trace-Id``), a hard body-size cap, request metrics.

The cap counts body bytes as they arrive (chunked or not, whatever Content-Length claims), for every route;
routes apply their own smaller limits the same way. Any failure that escaped the routes becomes a
problem+json answer, so no traceback ever leaves.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moorage.api.problem import PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, PayloadTooLarge
from moorage.fleet.forward import forwarded_trace_id
from moorage.log import get_logger
from moorage.observability import Metrics, new_span_id, new_trace_id, use_trace_id

log = get_logger(__name__)


def _problem_bytes(status: int, code: str, title: str, detail: str, hint: str, trace_id: str) -> bytes:
    return json.dumps({"type": PROBLEM_TYPE_BASE + code, "title": title, "status": status, "detail": detail,
                       "hint": hint, "trace_id": trace_id}).encode()


class BodyTooLarge(PayloadTooLarge):
    """Raised from ``receive`` once a body passes its limit: routes map it to 413 like any typed error."""


def limited_receive(receive: Receive, limit: int) -> Receive:
    """``receive`` that counts request body bytes as they arrive and raises ``BodyTooLarge`` past ``limit``.

    The server reads no further than the application asks (flow control), so refusing here keeps the rest of
    an oversized or endless body out of host memory.
    """
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(f"request body exceeds {limit} bytes", hint="send a smaller body")
        return message

    return counted


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # A request another host of the fleet forwarded keeps the trace id the caller was given there.
        forwarded = forwarded_trace_id(scope)  # signed by that host, else ignored (fleet/forward.py)
        trace_id, span_id = forwarded or new_trace_id(), new_span_id()
        state = scope.setdefault("state", {})
        state.update(trace_id=trace_id, span_id=span_id)
        status = {"code": 500, "started": False}

        async def send_with_trace(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-trace-id"]
                message = {**message, "headers": [*headers, (b"x-trace-id", trace_id.encode())]}
            await send(message)

        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        try:
            if declared.isdigit() and int(declared) > self.max_body:
                await self._reply(send_with_trace, 413, "payload-too-large", "Payload too large",
                                  f"request body is {int(declared)} bytes; the limit is {self.max_body}",
                                  "send a smaller body", trace_id)
                return
            with use_trace_id(trace_id, span_id):
                await self.app(scope, limited_receive(receive, self.max_body), send_with_trace)
        except BodyTooLarge as e:  # read by something that is not an Endpoint (which answers it itself)
            if not status["started"]:
                await self._reply(send_with_trace, 413, "payload-too-large", "Payload too large", e.message,
                                  e.hint or "send a smaller body", trace_id)
        except Exception:  # noqa: BLE001 - last resort; routes normally answer errors themselves
            log.exception("request failed outside a route", trace_id=trace_id)
            if not status["started"]:
                await self._reply(send_with_trace, 500, "internal", "Internal error",
                                  "the server failed to handle this request",
                                  f"report trace id {trace_id} to the operator", trace_id)
        finally:
            self.metrics.observe_request(scope.get("method", ""), state.get("route", "unmatched"), int(status["code"]))

    @staticmethod
    async def _reply(send: Send, status: int, code: str, title: str, detail: str, hint: str, trace_id: str) -> None:
        body = _problem_bytes(status, code, title, detail, hint, trace_id)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", PROBLEM_CONTENT_TYPE.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
