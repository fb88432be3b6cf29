"""The gateway's small parts on their own: Retry-After parsing, backoff, prices, secrets, tool replies."""

from __future__ import annotations

import email.utils
import random

import httpx
import pytest

from moorage.errors import InvalidInput
from moorage.llm import ChatRequest, Message, ModelPrice, PriceTable, ProviderUnavailable, RateLimited, RetryPolicy, Secret, ToolSpec, Usage
from moorage.llm._embedded_tools import parse
from moorage.llm._http import retry_after_seconds
from moorage.llm.errors import BadToolCall


def test_retry_after_forms() -> None:
    assert retry_after_seconds(httpx.Headers({"retry-after": "7"})) == 7
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "1500", "retry-after": "9"})) == 1.5
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_seconds(httpx.Headers({"retry-after": date}), now=1_000_000) == pytest.approx(30)
    assert retry_after_seconds(httpx.Headers({})) is None


def test_backoff_grows_and_tenant_limits_are_not_retried() -> None:
    policy = RetryPolicy(max_attempts=5, base_delay_s=1, max_delay_s=4)
    rng = random.Random(1)
    caps = [max(policy.delay(a, ProviderUnavailable("x"), rng) for _ in range(200)) for a in (1, 2, 3, 4)]
    assert caps[0] <= 1 and caps[1] <= 2 and 2 < caps[2] <= 4 and caps[3] <= 4
    assert policy.delay(5, ProviderUnavailable("x")) is None
    assert policy.delay(1, RateLimited("x", retry_after=2, scope="tenant")) is None
    assert policy.delay(1, RateLimited("x", retry_after=2)) >= 2


def test_price_lookup_order() -> None:
    t = PriceTable({"openai/gpt-4o": ModelPrice(5, 15), "gpt-4o": ModelPrice(1, 1), "gpt-4o-*": ModelPrice(0.15, 0.6, 0.075)})
    assert t.price("openai", "gpt-4o").input_per_mtok == 5
    assert t.price("azure", "gpt-4o").input_per_mtok == 1
    assert t.cost("openai", "gpt-4o-mini", Usage(1_000_000, 1_000_000, 1_000_000)) == pytest.approx(0.075 + 0.6)
    assert t.cost("x", "unknown", Usage(10, 10)) == 0


def test_secret_hides_itself() -> None:
    s = Secret("sk-abcdefghijklmnop")
    assert "abcdef" not in repr(s) + str(s) + f"{s}"
    assert s.redact("bad key sk-abcdefghijklmnop and sk-abcde...mnop") == "bad key *** and ***...mnop"
    with pytest.raises(TypeError):
        import pickle
        pickle.dumps(s)


def test_request_validation() -> None:
    with pytest.raises(InvalidInput, match="names no tool"):
        ChatRequest([Message.user("x")], tools=[ToolSpec("a")], tool_choice="b")
    with pytest.raises(InvalidInput, match="at least one message"):
        ChatRequest([])


def test_embedded_tool_reply_parsing() -> None:
    req = ChatRequest([Message.user("x")], tools=[ToolSpec("a")])
    text, calls = parse(req, '{"tool": "a", "arguments": {"k": 1}}', truncated=False)
    assert text == "" and calls[0].name == "a" and calls[0].arguments == {"k": 1}
    assert parse(req, '{"answer": "It is 18 \\u00b0C and su', truncated=True) == ("It is 18 °C and su", ())
    with pytest.raises(BadToolCall, match="raise max_tokens"):
        parse(req, '{"tool": "a", "argum', truncated=True)
