"""When and how long to wait before retrying a model call: exponential backoff with full jitter,
never less than the provider's Retry-After.

Retried: upstream ``RateLimited`` and ``ProviderUnavailable``. Never retried: the tenant's own limits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moorage.llm.errors import ProviderUnavailable, RateLimited


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0
    #: A Retry-After longer than this is not waited out: the error goes to the caller.
    max_retry_after_s: float = 60.0

    def delay(self, attempt: int, error: Exception, rng: random.Random | None = None) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or None to give up and raise ``error``."""
        if attempt >= self.max_attempts or not retryable(error):
            return None
        backoff = (rng or random).uniform(0, min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1))))
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            if retry_after > self.max_retry_after_s:
                return None
            # The server's number is a floor; a little jitter on top keeps tenants from retrying in lockstep.
            return retry_after + backoff * 0.1
        return backoff


def retryable(error: Exception) -> bool:
    if isinstance(error, RateLimited):
        return error.scope == "provider"
    return isinstance(error, ProviderUnavailable)
