"""The operator's LLM policy per tenant: which models its agents may call (a guest cannot pick another), its
rate limits and monthly token budget, and what a model without a price does (refused, or an explicit price).

Read from the TOML file the ``llm_policy`` setting names; tenants are named as in ``moorage store create-tenant``.
"""

from __future__ import annotations

import fnmatch
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from moorage.errors import ConfigError, MoorageError
from moorage.llm.limits import Budget, RateLimit, TenantLimits
from moorage.llm.pricing import ModelPrice, PriceTable

MONTH_S = 30 * 86400.0


class ModelNotAllowed(MoorageError):
    """The tenant's policy does not allow this model, or the model has no price and the policy refuses those."""

    code = "model-not-allowed"
    http_status = 403


@dataclass(frozen=True)
class TenantPolicy:
    #: Model names or globs the tenant may use (None: any model the provider serves).
    models: tuple[str, ...] | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    #: Input + output tokens per 30 days.
    tokens_per_month: int | None = None

    def limits(self) -> TenantLimits:
        return TenantLimits(
            requests=RateLimit(self.requests_per_minute) if self.requests_per_minute else None,
            tokens=RateLimit(self.tokens_per_minute) if self.tokens_per_minute else None,
            budget=Budget(self.tokens_per_month, MONTH_S) if self.tokens_per_month else None,
        )

    def allows(self, provider: str, model: str) -> bool:
        return self.models is None or any(fnmatch.fnmatchcase(model, p) or fnmatch.fnmatchcase(f"{provider}/{model}", p)
                                          for p in self.models)


@dataclass(frozen=True)
class LlmPolicy:
    default: TenantPolicy = TenantPolicy()
    #: By tenant name.
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    #: A model with no entry in the price table: ``refuse`` the call, or charge ``unknown_price``.
    unknown_models: Literal["refuse", "price"] = "refuse"
    unknown_price: ModelPrice | None = None
    prices: dict[str, ModelPrice] = field(default_factory=dict)

    def for_tenant(self, name: str | None) -> TenantPolicy:
        return self.tenants.get(name or "", self.default)

    def price_table(self, base: PriceTable | None = None) -> PriceTable:
        known = {**(base._prices if base is not None else {}), **self.prices}  # noqa: SLF001 - same package
        return PriceTable(known, default=self.unknown_price or (base.default if base is not None else PriceTable().default))


def _tenant(doc: Any, where: str) -> TenantPolicy:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where} must be a table")
    known = {"models", "requests_per_minute", "tokens_per_minute", "tokens_per_month"}
    extra = set(doc) - known
    if extra:
        raise ConfigError(f"{where}: unknown settings {sorted(extra)}", hint=f"known: {', '.join(sorted(known))}")
    models = doc.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise ConfigError(f"{where}.models must be a list of model names or globs")
    for k in ("requests_per_minute", "tokens_per_minute", "tokens_per_month"):
        v = doc.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{where}.{k} must be a positive number")
    return TenantPolicy(tuple(models) if models is not None else None, doc.get("requests_per_minute"),
                        doc.get("tokens_per_minute"), doc.get("tokens_per_month"))


def _price(doc: Any, where: str) -> ModelPrice:
    if not isinstance(doc, dict) or "input_per_mtok" not in doc or "output_per_mtok" not in doc:
        raise ConfigError(f"{where} needs input_per_mtok and output_per_mtok (USD per million tokens)")
    return ModelPrice(float(doc["input_per_mtok"]), float(doc["output_per_mtok"]),
                      None if doc.get("cached_input_per_mtok") is None else float(doc["cached_input_per_mtok"]))


def parse_policy(doc: dict[str, Any]) -> LlmPolicy:
    """The ``[llm]`` table of a policy file (see docs/llm.md)."""
    llm = doc.get("llm", doc)
    extra = set(llm) - {"unknown_models", "unknown_price", "prices", "default", "tenants"}
    if extra:  # a misspelt key would otherwise be ignored, and its limit or price with it
        raise ConfigError(f"llm: unknown settings {sorted(extra)}",
                          hint="known: default, tenants, prices, unknown_models, unknown_price (docs/llm.md)")
    unknown = llm.get("unknown_models", "refuse")
    if unknown not in ("refuse", "price"):
        raise ConfigError(f"llm.unknown_models = {unknown!r} is not refuse or price")
    unknown_price = _price(llm["unknown_price"], "llm.unknown_price") if "unknown_price" in llm else None
    if unknown == "price" and unknown_price is None:
        raise ConfigError("llm.unknown_models = \"price\" needs llm.unknown_price",
                          hint="set the price an unlisted model is charged, or refuse unlisted models")
    prices = {k: _price(v, f"llm.prices.{k}") for k, v in (llm.get("prices") or {}).items()}
    tenants = {k: _tenant(v, f"llm.tenants.{k}") for k, v in (llm.get("tenants") or {}).items()}
    return LlmPolicy(_tenant(llm.get("default", {}), "llm.default"), tenants, unknown, unknown_price, prices)


def load_policy(path: Path) -> LlmPolicy:
    try:
        return parse_policy(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read the LLM policy {path}: {e}", hint="fix the file or unset llm_policy") from e


class PolicyResolver:
    """Tenant id -> its policy, by the tenant's name in the store (looked up once per tenant)."""

    def __init__(self, policy: LlmPolicy, tenant_name: Callable[[str], str | None]) -> None:
        self.policy = policy
        self._name = tenant_name
        self._cache: dict[str, TenantPolicy] = {}
        self._lock = threading.Lock()

    def __call__(self, tenant_id: str) -> TenantPolicy:
        with self._lock:
            hit = self._cache.get(tenant_id)
        if hit is None:
            hit = self.policy.for_tenant(self._name(tenant_id))
            with self._lock:
                self._cache[tenant_id] = hit
        return hit


def is_priced(table: PriceTable, provider: str, model: str) -> bool:
    """Whether ``table`` names a price for this model (exactly or by a glob), rather than its default."""
    prices = table._prices  # noqa: SLF001 - same package
    if f"{provider}/{model}" in prices or model in prices:
        return True
    return any(fnmatch.fnmatchcase(f"{provider}/{model}", p) or fnmatch.fnmatchcase(model, p) for p in prices)
