"""Errors the client raises: one per kind of problem+json answer, each with the server's detail, hint and trace id.

``ApiError.retry_after`` carries the server's ``Retry-After`` (seconds) when it sent one; ``ApiError.retryable`` is
False when the server said the same request would fail the same way (``x-should-retry: false``, e.g. the agent's own
code raised), and then the client does not retry it.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """The server answered with an error (RFC 9457 problem+json), or could not be reached."""

    def __init__(self, status: int, detail: str, *, type: str = "", hint: str | None = None,
                 trace_id: str | None = None, retry_after: float | None = None, body: Any = None,
                 retryable: bool | None = None) -> None:
        super().__init__(f"{status} {detail}" + (f" ({hint})" if hint else ""))
        self.status = status
        self.detail = detail
        self.type = type
        self.hint = hint
        self.trace_id = trace_id
        self.retry_after = retry_after
        self.body = body
        self.retryable = retryable

    @property
    def code(self) -> str:
        """The problem type's last segment, e.g. ``overloaded`` or ``not-found``."""
        return self.type.rsplit("/", 1)[-1]


class BadRequest(ApiError):
    """400/413/415/422: the request itself is wrong; retrying it unchanged will not help."""


class AuthError(ApiError):
    """401/403: no valid credential, or its scopes do not allow this."""


class NotFound(ApiError):
    """404."""


class Conflict(ApiError):
    """409: a concurrent change, a busy instance or an idempotent request still in flight."""


class RateLimited(ApiError):
    """429: too many requests, or a cap was reached (``retry_after`` says when to come back)."""


class Unavailable(ApiError):
    """503 or the server could not be reached."""


class PoolExhausted(Unavailable):
    """Never sent: every connection of this client's pool stayed busy with its other calls for ``timeout_s`` (more
    calls at once than ``max_connections``). Not retried: raise the limit or make fewer calls at once."""


class ServerError(ApiError):
    """500/502: the server failed; quote ``trace_id`` to the operator."""


class DiskFull(ServerError):
    """507: the host is out of disk space. Nothing of the request was kept; once its operator frees space the same
    request succeeds (no restart needed). Not retried by the client: it does not pass in seconds."""


class InvalidArgument(BadRequest):
    """Refused before anything was sent: an argument no route could take (an empty id, ``..``)."""

    def __init__(self, detail: str, *, hint: str | None = None) -> None:
        super().__init__(400, detail, type="invalid-input", hint=hint)


def error_for(status: int, body: Any, headers: Any) -> ApiError:
    problem = body if isinstance(body, dict) else {}
    retry = _retry_after(headers.get("retry-after") if headers is not None else None)
    cls: type[ApiError]
    if status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = NotFound
    elif status == 409:
        cls = Conflict
    elif status == 429:
        cls = RateLimited
    elif status == 503:
        cls = Unavailable
    elif status == 507:
        cls = DiskFull
    elif status >= 500:
        cls = ServerError
    else:
        cls = BadRequest
    return cls(status, str(problem.get("detail") or body or f"HTTP {status}"), type=str(problem.get("type") or ""),
               hint=problem.get("hint"), trace_id=problem.get("trace_id") or (headers or {}).get("x-trace-id"),
               retry_after=retry, body=body, retryable=_should_retry(headers))


def _should_retry(headers: Any) -> bool | None:
    value = (headers.get("x-should-retry") if headers is not None else None) or ""
    return {"true": True, "false": False}.get(value.strip().lower())


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        from email.utils import parsedate_to_datetime
        import time

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
