"""Retry policy for failed steps: exponential backoff with jitter.

Delays are computed, never asserted; tests pass a zero base so that retries do not wait.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moorage.errors import InvalidInput


@dataclass(frozen=True)
class Backoff:
    """Delay before attempt ``n + 1`` after ``n`` failures: ``min(cap, base * factor ** (n - 1))`` less jitter.

    ``jitter`` is the fraction of that delay drawn at random and removed, so that many runs failing
    together (a rate limit, an outage) do not retry in lockstep.
    """

    base: float = 0.2
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.base < 0 or self.factor < 1 or self.cap < 0 or not 0 <= self.jitter <= 1:
            raise InvalidInput(
                f"bad backoff {self!r}", hint="base >= 0, factor >= 1, cap >= 0 and 0 <= jitter <= 1"
            )

    def delay(self, failures: int, rng: random.Random) -> float:
        raw = min(self.cap, self.base * self.factor ** max(0, failures - 1))
        return raw * (1 - self.jitter * rng.random())


DEFAULT_BACKOFF = Backoff()
#: For tests and for steps whose failures are not load-related: retry at once.
NO_WAIT = Backoff(base=0.0, jitter=0.0)
