"""What a model call costs: a configurable price table per model (USD per million tokens).

Cached input is priced separately because providers bill prompt-cache hits at a discount.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping

from moorage.llm.types import Usage


@dataclass(frozen=True)
class ModelPrice:
    input_per_mtok: float
    output_per_mtok: float
    #: Defaults to the full input price when the provider gives no cache discount.
    cached_input_per_mtok: float | None = None

    def cost(self, usage: Usage) -> float:
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return (
            (usage.input_tokens - cached) * self.input_per_mtok
            + cached * cached_price
            + usage.output_tokens * self.output_per_mtok
        ) / 1_000_000


FREE = ModelPrice(0.0, 0.0, 0.0)


class PriceTable:
    """Prices keyed by model name or glob (``"gpt-4o*"``), optionally scoped ``"provider/model"``.

    Lookup order: ``provider/model`` exact, ``model`` exact, then globs in insertion order;
    unknown models cost ``default`` (free unless set), so a missing price never blocks a call.
    """

    def __init__(self, prices: Mapping[str, ModelPrice] | None = None, *, default: ModelPrice = FREE) -> None:
        self._prices = dict(prices or {})
        self.default = default

    def price(self, provider: str, model: str) -> ModelPrice:
        for key in (f"{provider}/{model}", model):
            if key in self._prices:
                return self._prices[key]
        for pattern, price in self._prices.items():
            if fnmatch.fnmatchcase(f"{provider}/{model}", pattern) or fnmatch.fnmatchcase(model, pattern):
                return price
        return self.default

    def cost(self, provider: str, model: str, usage: Usage) -> float:
        return self.price(provider, model).cost(usage)
