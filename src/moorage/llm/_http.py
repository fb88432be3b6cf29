"""HTTP plumbing shared by the remote adapters: status → typed error, Retry-After, SSE parsing.

Only the adapters import this; callers see ``moorage.llm.errors`` types.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any, AsyncIterator

import httpx

from moorage.llm.errors import (
    ModelNotFound,
    ProviderAuthFailed,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
)
from moorage.llm.secret import Secret


def retry_after_seconds(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds the server asked us to wait: ``retry-after-ms``, ``Retry-After`` in seconds or as an HTTP date."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def upstream_message(body: bytes, secret: Secret) -> tuple[str, str]:
    """(message, error type) from an OpenAI- or Anthropic-style error body, with the key redacted."""
    text = body.decode("utf-8", "replace")
    kind = ""
    try:
        doc = json.loads(text)
        err = doc.get("error", doc) if isinstance(doc, dict) else {}
        if isinstance(err, dict):
            kind = str(err.get("type") or err.get("code") or "")
            text = str(err.get("message") or text)
        elif isinstance(err, str):
            text = err
    except ValueError:
        pass
    return secret.redact(text[:500]), kind


def raise_for_status(provider: str, response: httpx.Response, body: bytes, secret: Secret, model: str) -> None:
    """Turn a non-2xx answer into the typed error the gateway knows how to handle."""
    status = response.status_code
    if status < 400:
        return
    message, kind = upstream_message(body, secret)
    where = f"{provider} answered HTTP {status}"
    if status == 429:
        raise RateLimited(f"{where}: {message}", retry_after=retry_after_seconds(response.headers), provider=provider)
    if status in (401, 403):
        raise ProviderAuthFailed(
            f"{where}: {message}", provider=provider, status=status,
            hint=f"check the API key configured for {provider} (llm_api_key / MOORAGE_LLM_API_KEY)",
        )
    if status == 404 and (kind in ("not_found_error", "model_not_found", "NotFoundError") or "model" in message.lower()):
        raise ModelNotFound(
            f"{where}: model {model!r} not found: {message}", provider=provider, status=status,
            hint="check the model name (llm_model) against the provider's model list",
        )
    if status >= 500 or status == 408:
        raise ProviderUnavailable(
            f"{where}: {message}", provider=provider, status=status, hint="the provider is failing or overloaded; retry later"
        )
    raise ProviderError(f"{where}: {message}", provider=provider, status=status)


def connection_error(provider: str, base_url: str, exc: Exception) -> ProviderUnavailable:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "could not be reached"
    return ProviderUnavailable(
        f"{provider} at {base_url} {kind} ({type(exc).__name__})",
        provider=provider,
        hint="check llm_base_url and that the provider is up",
    )


def answered_whole(response: httpx.Response) -> bool:
    """A streamed request answered with one JSON body: a compatible server that ignores ``"stream": true``."""
    return response.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json"


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) pairs of a Server-Sent Events body; multi-line data joined with newlines."""
    event = ""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield event or "message", "\n".join(data)
            event, data = "", []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield event or "message", "\n".join(data)


def parse_json(provider: str, text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ProviderError(f"{provider} sent a body that is not JSON: {str(text)[:200]!r}", provider=provider) from e


async def post_json(client: httpx.AsyncClient, path: str, body: Any, headers: dict[str, str], *, provider: str,
                    base_url: str, secret: Secret, model: str) -> Any:
    """POST a JSON body and return the parsed JSON answer; transport failures, error statuses and bad JSON
    become the typed provider errors (with the credential scrubbed from any message)."""
    try:
        r = await client.post(path, json=body, headers=headers)
    except httpx.TransportError as e:
        raise connection_error(provider, base_url, e) from None
    raise_for_status(provider, r, r.content, secret, model)
    return parse_json(provider, r.content)
