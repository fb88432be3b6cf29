"""The gateway against real local wire servers: retries, per-tenant limits and budgets, accounting, secrecy."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from moorage.llm import (
    Admission,
    Budget,
    BudgetExceeded,
    ChatRequest,
    InMemoryUsageSink,
    LLMGateway,
    Message,
    ModelPrice,
    PriceTable,
    ProviderAuthFailed,
    ProviderUnavailable,
    RateLimit,
    RateLimited,
    RetryPolicy,
    Route,
    TenantLimits,
)

from .conftest import API_KEY, make_provider
from .wire_servers import MODEL, Canned, WireServer


def openai_ok(text: str = "ok", prompt: int = 20, completion: int = 5, cached: int = 0) -> Canned:
    return Canned(200, {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    })


def openai_error(status: int, headers: dict[str, str] | None = None) -> Canned:
    return Canned(status, {"error": {"message": f"scripted {status}", "type": "server_error"}}, headers or {})


class Sleeps:
    """Records the delays the gateway asks for instead of waiting them out."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hi(max_tokens: int = 5) -> ChatRequest:
    return ChatRequest([Message.user("hi")], max_tokens=max_tokens)


@pytest.fixture
async def gw(openai_server: WireServer, anthropic_server: WireServer) -> Any:
    sink = InMemoryUsageSink()
    sleeps = Sleeps()
    clock = Clock()
    gateway = LLMGateway(
        [make_provider("openai", openai_url=openai_server.url), make_provider("anthropic", anthropic_url=anthropic_server.url)],
        default_route="openai",
        routes={"tenant-claude": Route("anthropic")},
        admission=Admission(clock=clock),
        prices=PriceTable({"openai/" + MODEL: ModelPrice(2.0, 8.0, 0.5), "smollm2-*": ModelPrice(1.0, 1.0)}),
        usage_sink=sink,
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.2),
        sleep=sleeps,
    )
    gateway.sink, gateway.sleeps, gateway.clock = sink, sleeps, clock  # type: ignore[attr-defined]
    yield gateway
    await gateway.aclose()


async def test_retries_429_honouring_retry_after(gw: Any, openai_server: WireServer) -> None:
    openai_server.script.push(openai_error(429, {"Retry-After": "3"}), openai_ok("after wait"))
    r = await gw.complete("t1", hi())
    assert r.text == "after wait"
    assert len(openai_server.script.requests) == 2
    assert len(gw.sleeps.delays) == 1 and gw.sleeps.delays[0] >= 3.0
    assert len(gw.sink.records) == 1


async def test_retries_503_with_growing_backoff_then_gives_up(gw: Any, openai_server: WireServer) -> None:
    openai_server.script.push(openai_error(503), openai_error(502), openai_ok("third time"))
    assert (await gw.complete("t1", hi())).text == "third time"
    assert len(gw.sleeps.delays) == 2 and all(0 <= d <= 0.4 for d in gw.sleeps.delays)

    openai_server.script.push(openai_error(503), openai_error(503), openai_error(503))
    with pytest.raises(ProviderUnavailable, match="HTTP 503"):
        await gw.complete("t1", hi())
    assert gw.admission.used("t1") == 25, "a failed call must not use up budget"


async def test_retry_after_beyond_the_cap_is_returned_to_the_caller(gw: Any, openai_server: WireServer) -> None:
    openai_server.script.push(openai_error(429, {"Retry-After": "3600"}))
    with pytest.raises(RateLimited) as e:
        await gw.complete("t1", hi())
    assert e.value.retry_after == 3600 and e.value.scope == "provider"
    assert gw.sleeps.delays == []


async def test_connection_refused_is_retried_then_unavailable() -> None:
    from moorage.llm import OpenAICompatibleProvider

    sleeps = Sleeps()
    gateway = LLMGateway([OpenAICompatibleProvider("http://127.0.0.1:9/v1", API_KEY, MODEL)], retry=RetryPolicy(max_attempts=2), sleep=sleeps)
    with pytest.raises(ProviderUnavailable, match="could not be reached"):
        await gateway.complete("t1", hi())
    assert len(sleeps.delays) == 1
    await gateway.aclose()


async def test_stream_retries_before_the_first_chunk(gw: Any, openai_server: WireServer) -> None:
    openai_server.script.push(openai_error(503))
    chunks = [c async for c in gw.stream("t1", ChatRequest([Message.user("Say hi")], max_tokens=4, temperature=0), trace_id="tr-s")]
    assert "".join(c.text for c in chunks)
    assert len(gw.sleeps.delays) == 1
    rec = gw.sink.records[-1]
    assert rec.trace_id == "tr-s" and rec.output_tokens > 0 and rec.input_tokens > 0


async def test_a_stream_answered_as_one_json_body_is_the_whole_answer(gw: Any, openai_server: WireServer,
                                                                     anthropic_server: WireServer) -> None:
    # Some compatible servers ignore "stream": true and answer the whole completion at once (application/json).
    openai_server.script.push(openai_ok("all at once", prompt=12, completion=3))
    anthropic_server.script.push(Canned(200, {
        "id": "msg_2", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": "whole "}, {"type": "text", "text": "reply"}],
        "stop_reason": "max_tokens", "usage": {"input_tokens": 9, "output_tokens": 2},
    }))
    for tenant, text, finish, tokens in (("t1", "all at once", "stop", (12, 3)), ("tenant-claude", "whole reply", "length", (9, 2))):
        chunks = [c async for c in gw.stream(tenant, hi())]
        assert "".join(c.text for c in chunks) == text
        assert chunks[-1].finish_reason == finish
        rec = gw.sink.records[-1]
        assert (rec.input_tokens, rec.output_tokens) == tokens  # accounted from the body's usage, not estimated
    assert all(server.script.requests[-1]["body"]["stream"] is True for server in (openai_server, anthropic_server))


async def test_request_rate_limit_is_per_tenant(gw: Any, openai_server: WireServer) -> None:
    gw.admission.set_limits("a", TenantLimits(requests=RateLimit(per_minute=2)))
    openai_server.script.push(*[openai_ok() for _ in range(5)])
    await gw.complete("a", hi())
    await gw.complete("a", hi())
    with pytest.raises(RateLimited) as e:
        await gw.complete("a", hi())
    assert e.value.scope == "tenant" and 0 < e.value.retry_after <= 30
    await gw.complete("b", hi())  # tenant b is not slowed by a
    gw.clock.now += 30  # one request refills every 30 s
    await gw.complete("a", hi())
    assert len(openai_server.script.requests) == 4, "a rate-limited call never reaches the provider"


async def test_token_rate_limit(gw: Any, openai_server: WireServer) -> None:
    gw.admission.set_limits("a", TenantLimits(tokens=RateLimit(per_minute=60)))
    openai_server.script.push(openai_ok(prompt=50, completion=10), openai_ok())
    await gw.complete("a", hi())
    with pytest.raises(RateLimited, match="tokens"):
        await gw.complete("a", hi())
    gw.clock.now += 60
    await gw.complete("a", hi())


async def test_budget_is_per_tenant_and_resets_with_its_window(gw: Any, openai_server: WireServer) -> None:
    gw.admission.set_limits("a", TenantLimits(budget=Budget(tokens=100, window_s=3600)))
    openai_server.script.push(openai_ok(prompt=60, completion=20), openai_ok(), openai_ok(), openai_ok())
    await gw.complete("a", hi())
    assert gw.admission.used("a") == 80
    with pytest.raises(BudgetExceeded) as e:
        await gw.complete("a", ChatRequest([Message.user("hi")], max_tokens=30))
    assert "'a'" in str(e.value) and "100-token budget" in str(e.value) and e.value.resets_in is not None
    await gw.complete("b", hi())  # b has no budget and a's does not touch it
    await gw.complete("a", hi(max_tokens=5))  # a small call still fits
    gw.clock.now += 3600
    await gw.complete("a", ChatRequest([Message.user("hi")], max_tokens=30))
    assert gw.admission.used("a") == 25


async def test_accounting_records_tokens_cost_and_cached_input(gw: Any, openai_server: WireServer) -> None:
    openai_server.script.push(openai_ok(prompt=1000, completion=200, cached=600))
    entity = {"agent_id": "ag1", "user_id": "u1", "session_id": "s1"}
    r = await gw.complete("t1", hi(), entity=entity, trace_id="trace-42")
    assert r.usage.cached_input_tokens == 600
    (rec,) = gw.sink.records
    assert (rec.tenant_id, rec.entity, rec.provider, rec.model, rec.trace_id) == ("t1", entity, "openai", MODEL, "trace-42")
    assert (rec.input_tokens, rec.output_tokens, rec.cached_input_tokens) == (1000, 200, 600)
    assert rec.cost_usd == pytest.approx((400 * 2.0 + 600 * 0.5 + 200 * 8.0) / 1e6)
    assert rec.latency_ms > 0


async def test_anthropic_cache_reads_are_recorded_as_cached_input(gw: Any, anthropic_server: WireServer) -> None:
    anthropic_server.script.push(Canned(200, {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 4, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 70},
    }))
    await gw.complete("tenant-claude", hi())
    (rec,) = gw.sink.records
    assert rec.provider == "anthropic"
    assert (rec.input_tokens, rec.cached_input_tokens, rec.output_tokens) == (1000, 900, 4)
    assert rec.cost_usd == pytest.approx((1000 + 4) * 1.0 / 1e6)  # the glob price, no cache discount


async def test_real_model_through_the_gateway(gw: Any) -> None:
    r = await gw.complete("tenant-claude", ChatRequest([Message.user("Say hello.")], max_tokens=4, temperature=0))
    assert r.text and r.provider == "anthropic"
    (rec,) = gw.sink.records
    assert rec.input_tokens == r.usage.input_tokens > 0 and rec.output_tokens == r.usage.output_tokens > 0


async def test_api_key_never_appears_in_errors_logs_or_reprs(
    openai_server: WireServer, anthropic_server: WireServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-77c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5"
    providers = [make_provider("openai", openai_url=openai_server.url, key=wrong), make_provider("anthropic", anthropic_url=anthropic_server.url, key=wrong)]
    gateway = LLMGateway(providers, routes={"x": Route("anthropic")})
    texts = [repr(gateway), *map(repr, providers), *map(str, providers)]
    for tenant in ("t", "x"):
        with pytest.raises(ProviderAuthFailed) as e:
            await gateway.complete(tenant, hi())
        texts += [str(e.value), repr(e.value), e.value.hint or ""]
    joined = " ".join(texts)
    assert "Incorrect API key provided: ***" in joined and "invalid x-api-key" in joined, "upstream messages kept, key redacted"
    texts += [r.getMessage() + " " + str(vars(r)) for r in caplog.records]
    assert openai_server.script.requests[0]["headers"]["authorization"] == f"Bearer {wrong}", "the key did go on the wire"
    for t in texts:
        assert wrong not in t and wrong[:8] not in t and API_KEY not in t
    await gateway.aclose()


async def test_unknown_route_fails_at_start_up() -> None:
    from moorage.errors import NotFound

    with pytest.raises(NotFound, match="no LLM provider named 'nope'"):
        LLMGateway([make_provider("embedded")], routes={"t": Route("nope")})


async def test_stream_closed_early_is_still_accounted(gw: Any) -> None:
    stream = gw.stream("t1", ChatRequest([Message.user("Count from one to twenty.")], max_tokens=20, temperature=0))
    async for chunk in stream:
        if chunk.text:
            break
    await stream.aclose()
    (rec,) = gw.sink.records
    assert rec.input_tokens > 0 and rec.output_tokens >= 1
    assert gw.admission.used("t1") == rec.input_tokens + rec.output_tokens
