"""RFC 9457 problem+json: the one error format every route returns, built from typed moorage errors.

A problem never contains a traceback; unexpected failures become a 500 that points at the trace id.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import Response

from moorage.errors import MoorageError
from moorage.log import get_logger

log = get_logger(__name__)

PROBLEM_TYPE_BASE = "https://moorage.dev/problems/"
PROBLEM_CONTENT_TYPE = "application/problem+json"

_TITLES = {
    400: "Bad request", 401: "Unauthenticated", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
    406: "Not acceptable", 409: "Conflict", 413: "Payload too large", 415: "Unsupported media type",
    422: "Invalid input", 429: "Too many requests", 500: "Internal error", 503: "Unavailable",
    507: "Insufficient storage",
}


#: ``Retry-After`` for a 429 or 503 whose error names no wait of its own: every such answer carries the header,
#: so clients that honour it (the official ``openai`` SDK, moorage's own) back off instead of hammering. Not one
#: that says no retry helps (``x-should-retry: false``: a token budget that never resets).
DEFAULT_RETRY_AFTER_S = {429: 1, 503: 5}
#: Error attributes that say how long to wait, in the order they are trusted.
_RETRY_ATTRS = ("retry_after", "retry_after_s", "resets_in")


def retry_after_of(err: BaseException) -> float | None:
    """Seconds the error asks a caller to wait before retrying, if it says (any of ``_RETRY_ATTRS``)."""
    for name in _RETRY_ATTRS:
        value = getattr(err, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and 0 <= value < 1e9:
            return float(value)
    return None


class PayloadTooLarge(MoorageError):
    code = "payload-too-large"
    http_status = 413


class MethodNotAllowed(MoorageError):
    code = "method-not-allowed"
    http_status = 405


class UnsupportedMediaType(MoorageError):
    code = "unsupported-media-type"
    http_status = 415


def problem(status: int, code: str, detail: str, *, hint: str | None = None, trace_id: str | None = None,
            headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> Response:
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + code,
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "hint": hint,
        "trace_id": trace_id,
        **(extra or {}),
    }
    headers = dict(headers or {})
    final = any(k.lower() == "x-should-retry" and v == "false" for k, v in headers.items())
    if status in DEFAULT_RETRY_AFTER_S and not final and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(DEFAULT_RETRY_AFTER_S[status])
        body.setdefault("retry_after", DEFAULT_RETRY_AFTER_S[status])
    return Response(json.dumps(body), status_code=status, media_type=PROBLEM_CONTENT_TYPE, headers=headers)


def from_error(err: MoorageError, trace_id: str | None) -> Response:
    """Map any MoorageError (and subclasses defined by other parts) to its problem response."""
    status = int(getattr(err, "http_status", 500) or 500)
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {}
    retry_after = retry_after_of(err)
    if retry_after is not None and status in DEFAULT_RETRY_AFTER_S:
        # Whole seconds (RFC 9110), rounded up so a client never comes back before the wait is over.
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        extra["retry_after"] = round(retry_after, 3)  # the precise wait; the header rounds it up
    current = getattr(err, "current_version", None)
    if isinstance(current, int):
        extra["current_version"] = current
    if getattr(err, "retryable", None) is False:
        headers["x-should-retry"] = "false"  # honoured by this project's SDK and the openai client
    if status >= 500 and status != 503 and not getattr(err, "for_caller", False):
        # Internal details stay in the log; the caller gets the trace id to quote.
        log.error("request failed (details not shown to the caller)", code=err.code, error=err.message,
                  hint=err.hint, trace_id=trace_id)
        return problem(status, err.code, "the server failed to handle this request",
                       hint=f"report trace id {trace_id} to the operator", trace_id=trace_id, headers=headers)
    return problem(status, err.code, err.message, hint=err.hint, trace_id=trace_id, headers=headers, extra=extra)


def openai_error(problem_body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error object for a problem (``message``, ``type``, ``code``): what the official ``openai`` clients
    read an error from. Without it they said only "Error code: 404", or "An error occurred during streaming"."""
    code = str(problem_body.get("type") or "error").removeprefix(PROBLEM_TYPE_BASE)
    detail, hint = str(problem_body.get("detail") or code), problem_body.get("hint")
    return {"message": f"{detail} ({hint})" if hint else detail, "type": code, "code": code, "param": None}


def with_openai_error(response: Response) -> Response:
    """A problem answer of the OpenAI-compatible routes, with OpenAI's ``error`` object beside its own members."""
    if response.media_type != PROBLEM_CONTENT_TYPE or not getattr(response, "body", None):
        return response
    body = json.loads(response.body)
    body["error"] = openai_error(body)
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return Response(json.dumps(body), status_code=response.status_code, media_type=PROBLEM_CONTENT_TYPE,
                    headers=headers)


def internal(trace_id: str | None) -> Response:
    return problem(500, "internal", "the server failed to handle this request",
                   hint=f"retry later; if it persists report trace id {trace_id} to the operator", trace_id=trace_id)
