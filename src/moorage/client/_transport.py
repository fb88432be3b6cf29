"""What the sync and async clients share around one HTTP exchange: settings, retry decisions, answer decoding.

Retries cover 429, 502, 503, 504 and connection failures, unless the server says the same request would fail the
same way (``x-should-retry: false``: the agent's own code raised). A mutating request gets an ``Idempotency-Key``
before its first attempt (unless the caller gave one), so a retry never acts twice.
"""

from __future__ import annotations

import dataclasses
import json
import random
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import httpx

from moorage.client._api import Request
from moorage.client._local import local_admin_key, local_config, server
from moorage.client.errors import ApiError, Conflict, PoolExhausted, Unavailable, error_for

RETRY_STATUSES = frozenset({429, 502, 503, 504})
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class Settings:
    base_url: str
    api_key: str | None
    timeout_s: float = 600.0
    #: Further attempts after the first, for retryable answers only.
    max_retries: int = 3
    #: Backoff when the server names no wait: base * 2**attempt, with jitter, at most ``max_wait_s``.
    backoff_s: float = 0.5
    #: The longest wait honoured (a longer ``Retry-After`` is an error handed to the caller at once).
    max_wait_s: float = 60.0
    #: Where ``base_url`` came from when it was not given (said when it cannot be reached).
    url_from: str = ""
    #: Connections open at once (httpx's default); a call past them waits up to ``timeout_s`` for one to free.
    max_connections: int = 100

    @classmethod
    def resolve(cls, base_url: str | None, api_key: str | None, **kw: Any) -> "Settings":
        options = {k: v for k, v in kw.items() if v is not None}
        if base_url and api_key is not None:
            return cls(base_url.rstrip("/"), api_key, **options)
        # What the CLI run here finds (client/_local.py): its config's api_url, api_key and data_dir (from
        # ./moorage.toml too), the address and the admin key the `moorage up` of that data directory wrote there.
        cfg = local_config()
        url, url_from = (base_url, "") if base_url else server(cfg)
        key = api_key if api_key is not None else cfg.api_key or local_admin_key(url, cfg.data_dir)
        return cls(url.rstrip("/"), key, url_from=url_from, **options)

    def limits(self) -> httpx.Limits:
        return httpx.Limits(max_connections=self.max_connections,
                            max_keepalive_connections=min(20, self.max_connections))

    def headers(self) -> dict[str, str]:
        h = {"user-agent": "moorage-python"}
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        return h


def prepare(req: Request) -> Request:
    """The request as first sent: a mutating one carries an Idempotency-Key from here on."""
    if req.method in MUTATING and not any(k.lower() == "idempotency-key" for k in req.headers):
        return dataclasses.replace(req, headers={**req.headers, "Idempotency-Key": f"sdk-{uuid.uuid4().hex}"})
    return req


def check_shown_once(req: Request, body: Any) -> Any:
    """``body``, unless it is the replay of a create whose one-time secret went to an earlier attempt whose answer
    was lost (the server never keeps it, so a retry's answer has it null): that is a ``Conflict`` saying so."""
    if req.shown_once is None or not isinstance(body, dict) or body.get(req.shown_once) is not None:
        return body
    return_id = body.get("id") or body.get("user")
    raise Conflict(409, f"{req.method} {req.path} was done by an earlier attempt whose answer was lost on the way; "
                        f"its {req.shown_once} is shown only once, so this answer (a replay) does not have it",
                   type="secret-not-shown", hint=req.shown_once_hint.format(id=return_id), body=body, retryable=False)


def kwargs(req: Request) -> dict[str, Any]:
    kw: dict[str, Any] = {"params": req.params or None, "headers": req.headers}
    if req.content is not None:
        kw["content"] = req.content
    elif req.json is not None:
        kw["json"] = req.json
    return kw


def decode(response: httpx.Response) -> Any:
    """The answer's JSON (None when it has none); any status outside 2xx is an error, with a body or without
    (a proxy's bare 404, a redirect this API never sends)."""
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = response.text
    if not 200 <= response.status_code < 300:
        raise error_for(response.status_code, body, response.headers)
    return None if response.status_code == 204 else body


#: Transport failures that happen before a request is sent: it cannot have been done.
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def may_have_run(error: ApiError) -> bool:
    """Whether the server may have done the request that failed so: a gateway's 502/504 (the server may have
    answered it), or a connection lost once the request was sent. A 429 or 503 answer is a refusal."""
    if error.code == "unreachable":
        return not isinstance(error.__cause__, UNSENT)
    return error.status in (502, 504)


def wait_before_retry(settings: Settings, attempt: int, error: ApiError, req: Request | None = None) -> float | None:
    """Seconds to wait before attempt ``attempt + 1``, or None when the error must reach the caller."""
    if attempt >= settings.max_retries or error.status not in RETRY_STATUSES or error.retryable is False:
        return None
    if req is not None and req.repeats and may_have_run(error):
        return None
    if error.retry_after is not None:
        return None if error.retry_after > settings.max_wait_s else error.retry_after
    return min(settings.max_wait_s, settings.backoff_s * (2 ** attempt) * (0.5 + random.random()))


def unreachable(settings: Settings, e: Exception) -> Unavailable:
    if isinstance(e, httpx.PoolTimeout):
        return pool_exhausted(settings)
    origin = f" ({settings.url_from})" if settings.url_from else ""
    error = Unavailable(503, f"cannot reach {settings.base_url}{origin}: {type(e).__name__}: {e}",
                        type="unreachable", hint="check the URL and that `moorage up` is running")
    error.__cause__ = e  # whether it was sent at all (may_have_run)
    return error


def pool_exhausted(settings: Settings) -> PoolExhausted:
    """The call waited ``timeout_s`` for a connection of the client's own pool and got none: the server was never
    asked (it may be well), this client had more calls in flight than its ``max_connections``."""
    return PoolExhausted(503, f"this call was not sent: all {settings.max_connections} connections of this client "
                              f"stayed busy with its other calls for {settings.timeout_s:g} s",
                         type="pool-exhausted", retryable=False,
                         hint=f"make fewer calls at once with one client, or raise its limit (Client(..., "
                              f"max_connections=N); it is {settings.max_connections})")


def final(req: Request, error: ApiError) -> ApiError:
    """The error handed to the caller: for a request the server does again when repeated, after a failure that may
    have come once it was done, a hint saying so (the caller decides whether to send it again)."""
    if req.repeats and may_have_run(error):
        error.hint = (f"{req.method} {req.path} may have run on the server before this failure, and the server runs "
                      "it again if it is sent again, so it was not retried: check before sending it again (a detached "
                      "exec with an idempotency_key is safe to repeat)")
        Exception.__init__(error, f"{error.status} {error.detail} ({error.hint})")
    return error


def cut_off(settings: Settings, e: Exception) -> Unavailable:
    """A stream whose connection failed after its first events: not retried (they were handed over already)."""
    return Unavailable(503, f"the stream from {settings.base_url} was cut off: {type(e).__name__}: {e}",
                       type="unreachable", hint="ask again: a turn with the same idempotency_key answers its result, "
                                                "follow_exec starts from the oldest output kept")


def raise_error_event(event: str, data: Any) -> None:
    """A stream's ``error`` event (a failure after the stream began: the agent raised, the turn was refused midway) is
    raised as the ``ApiError`` the same failure gives ``invoke``; it is not retried (the turn had started)."""
    if event != "error":
        return
    problem = data if isinstance(data, dict) else {"detail": str(data)}
    status = problem.get("status") if isinstance(problem.get("status"), int) else 500
    type_ = str(problem.get("type") or "")
    if type_ and "/" not in type_:
        type_ = f"https://moorage.dev/problems/{type_}"
    error = error_for(status, {**problem, "type": type_}, {})
    error.retryable = False
    raise error


def is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip() == "text/event-stream"


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """(event, data) pairs from server-sent event lines."""
    event, data = "message", []
    for line in lines:
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    yield event, json.loads(text)
                except ValueError:
                    yield event, text
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
