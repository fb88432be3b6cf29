"""The LLM gateway: the one door every model call from every tenant goes through.

Routes a tenant's call to its provider, enforces its rate limits and budget, retries transient
failures, prices the call and reports it to the ``UsageSink``. Credentials never leave it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from moorage.errors import ConfigError, NotFound
from moorage.llm.limits import Admission
from moorage.llm.policy import ModelNotAllowed, TenantPolicy, is_priced
from moorage.llm.pricing import PriceTable
from moorage.llm.provider import Provider
from moorage.llm.retry import RetryPolicy
from moorage.llm.types import ChatChunk, ChatRequest, ChatResponse, Message, ToolSpec, Usage
from moorage.llm.usage import UsageSink
from moorage.log import get_logger

log = get_logger(__name__)

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    """Which provider (by name) and model serve a tenant; an empty model means the provider's default."""

    provider: str
    model: str = ""


class LLMGateway:
    def __init__(
        self,
        providers: Mapping[str, Provider] | Sequence[Provider],
        *,
        default_route: Route | str | None = None,
        routes: Mapping[str, Route] | None = None,
        admission: Admission | None = None,
        prices: PriceTable | None = None,
        usage_sink: UsageSink | None = None,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Sleep = asyncio.sleep,
        policy: "Callable[[str], TenantPolicy] | None" = None,
        refuse_unpriced: bool = False,
    ) -> None:
        if not isinstance(providers, Mapping):
            providers = {p.name: p for p in providers}
        if not providers:
            raise ConfigError("the LLM gateway needs at least one provider")
        self._providers = dict(providers)
        if default_route is None:
            default_route = Route(next(iter(self._providers)))
        self._default = Route(default_route) if isinstance(default_route, str) else default_route
        self._routes = dict(routes or {})
        for r in [self._default, *self._routes.values()]:
            self._provider(r)  # fail at start-up, not on a tenant's first call
        self.admission = admission or Admission()
        self.prices = prices or PriceTable()
        self.usage_sink = usage_sink
        self.retry = retry
        self._sleep = sleep
        #: The operator's per-tenant policy (models, limits, budget); None: every tenant may call any model.
        self.policy = policy
        #: Refuse models the price table does not name (the operator's rule: never free by accident).
        self.refuse_unpriced = refuse_unpriced
        self._policed: set[str] = set()

    def __repr__(self) -> str:
        return f"LLMGateway(providers={sorted(self._providers)}, default={self._default.provider!r})"

    # --- routing -----------------------------------------------------------------------

    def route(self, tenant_id: str) -> Route:
        return self._routes.get(tenant_id, self._default)

    def set_route(self, tenant_id: str, route: Route) -> None:
        self._provider(route)
        self._routes[tenant_id] = route

    def _provider(self, route: Route) -> Provider:
        try:
            return self._providers[route.provider]
        except KeyError:
            raise NotFound(
                f"no LLM provider named {route.provider!r}", hint=f"configured providers: {', '.join(sorted(self._providers))}"
            ) from None

    def _resolve(self, tenant_id: str, request: ChatRequest) -> tuple[Provider, ChatRequest]:
        route = self.route(tenant_id)
        provider = self._provider(route)
        model = request.model or route.model
        # The tenant is the prompt-cache scope: a cache hit (its count, its speed) never crosses tenants.
        return provider, replace(request, model=model, cache_scope=tenant_id)

    def _check_policy(self, tenant_id: str, provider: Provider, request: ChatRequest) -> None:
        """The operator's rules for this tenant, before anything is reserved or sent: the model must be allowed
        (whatever the guest asked for) and priced; the tenant's limits are installed on first use."""
        model = request.model or getattr(provider, "default_model", "") or ""
        if self.policy is not None:
            pol = self.policy(tenant_id)
            if tenant_id not in self._policed:
                self.admission.set_limits(tenant_id, pol.limits())
                self._policed.add(tenant_id)
            if not pol.allows(provider.name, model):
                raise ModelNotAllowed(f"model {model!r} is not allowed for this tenant",
                                      hint=f"allowed: {', '.join(pol.models or ())}; the operator sets this in the LLM policy")
        if self.refuse_unpriced and not is_priced(self.prices, provider.name, model):
            raise ModelNotAllowed(f"model {model!r} has no price and this installation refuses unpriced models",
                                  hint="the operator adds it under [llm.prices], or sets unknown_models = \"price\" "
                                       "with the unknown_price it is charged")

    # --- calls -------------------------------------------------------------------------

    async def count_tokens(self, tenant_id: str, messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
        provider, _ = self._resolve(tenant_id, ChatRequest([Message.user("")]))
        return await provider.count_tokens(messages, tools)

    async def _reserve(self, tenant_id: str, provider: Provider, request: ChatRequest) -> tuple[int, int]:
        """(input estimate, reservation): the call holds input + max_tokens until it settles."""
        input_estimate = await provider.count_tokens(request.messages, request.tools)
        reservation = input_estimate + (request.max_tokens or 0)
        self.admission.admit(tenant_id, reservation)
        return input_estimate, reservation

    async def complete(
        self,
        tenant_id: str,
        request: ChatRequest,
        *,
        entity: Mapping[str, str] | None = None,
        trace_id: str | None = None,
    ) -> ChatResponse:
        """One model call for ``tenant_id``, retried on transient provider failures."""
        provider, request = self._resolve(tenant_id, request)
        self._check_policy(tenant_id, provider, request)
        _, reservation = await self._reserve(tenant_id, provider, request)
        started = time.perf_counter()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await provider.complete(request)
                break
            except Exception as e:
                delay = self.retry.delay(attempt, e)
                if delay is None:
                    self.admission.settle(tenant_id, reservation, 0)
                    log.warning("llm call failed", tenant=tenant_id, provider=provider.name, attempts=attempt, error=type(e).__name__)
                    raise
                log.info("llm call retry", tenant=tenant_id, provider=provider.name, attempt=attempt, delay_s=round(delay, 3), error=type(e).__name__)
                await self._sleep(delay)
        latency_ms = (time.perf_counter() - started) * 1000
        self.admission.settle(tenant_id, reservation, response.usage.total_tokens)
        await self._account(tenant_id, entity, provider.name, response.model or request.model, response.usage, latency_ms, trace_id)
        return replace(response, latency_ms=latency_ms)

    async def stream(
        self,
        tenant_id: str,
        request: ChatRequest,
        *,
        entity: Mapping[str, str] | None = None,
        trace_id: str | None = None,
    ) -> AsyncIterator[ChatChunk]:
        """Stream one call. Retries happen only before the first chunk: after that the caller has
        already seen part of an answer, and a retry would produce a different one."""
        provider, request = self._resolve(tenant_id, request)
        self._check_policy(tenant_id, provider, request)
        input_estimate, reservation = await self._reserve(tenant_id, provider, request)
        started = time.perf_counter()
        attempt = 0
        usage: Usage | None = None
        model = request.model
        emitted = 0
        settled = False
        try:
            while True:
                attempt += 1
                try:
                    async for chunk in provider.stream(request):
                        emitted += 1
                        usage = chunk.usage or usage
                        model = chunk.model or model
                        yield chunk
                    break
                except Exception as e:
                    delay = None if emitted else self.retry.delay(attempt, e)
                    if delay is None:
                        self.admission.settle(tenant_id, reservation, 0)
                        settled = True
                        log.warning("llm stream failed", tenant=tenant_id, provider=provider.name, attempts=attempt, error=type(e).__name__)
                        raise
                    log.info("llm stream retry", tenant=tenant_id, provider=provider.name, attempt=attempt, delay_s=round(delay, 3), error=type(e).__name__)
                    await self._sleep(delay)
        finally:
            if not settled:
                if usage is None:
                    # The caller stopped reading before the provider reported usage: charge the estimate
                    # of what was sent plus one token per chunk seen, rather than nothing.
                    usage = Usage(input_tokens=input_estimate, output_tokens=emitted)
                    log.info("llm stream closed early, usage estimated", tenant=tenant_id, provider=provider.name)
                self.admission.settle(tenant_id, reservation, usage.total_tokens)
                latency_ms = (time.perf_counter() - started) * 1000
                await self._account(tenant_id, entity, provider.name, model or provider.default_model, usage, latency_ms, trace_id)

    async def _account(
        self,
        tenant_id: str,
        entity: Mapping[str, str] | None,
        provider: str,
        model: str,
        usage: Usage,
        latency_ms: float,
        trace_id: str | None,
    ) -> None:
        cost = self.prices.cost(provider, model, usage)
        fields = dict(
            tenant_id=tenant_id,
            entity=dict(entity or {}),
            provider=provider,
            model=model,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            cost_usd=cost,
            latency_ms=round(latency_ms, 3),
            trace_id=trace_id,
        )
        log.info("llm call", **{k: v for k, v in fields.items() if k != "entity"})
        if self.usage_sink is None:
            return
        try:
            result = self.usage_sink.record(**fields)
            if inspect.isawaitable(result):
                await result
        except Exception:
            # The answer is already paid for upstream; losing it now would not refund anyone. The
            # full record is in this log line so the ledger can be repaired from logs.
            log.exception("usage sink failed; record only in this log line", **{k: v for k, v in fields.items() if k != "entity"}, entity=str(fields["entity"]))

    async def aclose(self) -> None:
        for p in self._providers.values():
            await p.aclose()
