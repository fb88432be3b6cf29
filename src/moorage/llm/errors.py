"""Typed errors of model calls: what went wrong upstream, or which local limit stopped the call.

The gateway retries only ``RateLimited`` from a provider and ``ProviderUnavailable``; the rest reach the caller.
"""

from __future__ import annotations

from typing import Literal

from moorage.errors import MoorageError, NotFound, UnavailableError


class ProviderError(MoorageError):
    """The model provider refused or failed the call (bad request, unexpected answer)."""

    code = "llm-provider"
    http_status = 502

    def __init__(self, message: str, *, provider: str = "", status: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.provider = provider
        self.status = status


class ProviderAuthFailed(ProviderError):
    """The provider rejected the credentials configured in the gateway."""

    code = "llm-auth"


class RateLimited(ProviderError):
    """Too many requests or tokens: wait ``retry_after`` seconds (if known) and try again.

    ``scope`` says who limited: ``provider`` (an upstream 429) or ``tenant`` (this gateway's
    per-tenant limits).
    """

    code = "rate-limited"
    http_status = 429

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        scope: Literal["provider", "tenant"] = "provider",
        provider: str = "",
        status: int | None = 429,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, provider=provider, status=status, hint=hint or _retry_hint(retry_after))
        self.retry_after = retry_after
        self.scope = scope


class ProviderUnavailable(ProviderError, UnavailableError):
    """The provider could not be reached or is overloaded (5xx, timeout, connection refused)."""

    code = "llm-unavailable"
    http_status = 503


class ModelNotFound(ProviderError, NotFound):
    """The provider does not serve the requested model."""

    code = "model-not-found"
    http_status = 404


class BadToolCall(ProviderError):
    """The model produced a tool call that is not valid (unknown tool, arguments not JSON)."""

    code = "bad-tool-call"


class BudgetExceeded(MoorageError):
    """A tenant's token budget for the current period is used up."""

    code = "budget-exceeded"
    http_status = 429

    def __init__(self, message: str, *, tenant_id: str, limit: int, used: int, resets_in: float | None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.tenant_id = tenant_id
        self.limit = limit
        self.used = used
        self.resets_in = resets_in
        if resets_in is None:
            # A budget that never resets refuses the same call for good: no Retry-After, and clients told not to
            # retry (``x-should-retry: false``); only a larger budget helps.
            self.retryable = False


def _retry_hint(retry_after: float | None) -> str:
    if retry_after is None:
        return "retry later"
    return f"retry in {retry_after:.1f} s"
