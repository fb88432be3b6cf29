"""Working memory: prefix stability under compaction, the hard budget, determinism and persistence."""

from __future__ import annotations

import json

import pytest

from moorage.memory.context import CompactionPolicy, ContextBuilder
from moorage.memory.errors import ContextBudgetError
from moorage.memory.summarize import ExtractiveSummarizer
from moorage.memory.tokens import ApproxTokenCounter, MiniLMTokenCounter

from .session_script import SYSTEM_PROMPT, session, tool_schemas


def _drive(builder: ContextBuilder, turns: int, seed: int = 7) -> list:
    calls = []
    for role, content in session(turns, seed):
        builder.add(role, content)
        if role != "assistant":  # the model is called after each user message and each tool result
            calls.append(builder.build())
    return calls


def test_200_turn_session_keeps_90_percent_prefix_reuse_and_the_budget() -> None:
    policy = CompactionPolicy(budget_tokens=6144)
    builder = ContextBuilder(SYSTEM_PROMPT, tool_schemas(), policy=policy)
    calls = _drive(builder, 200)

    assert builder.stats.compactions >= 5, "the session must be long enough to compact several times"
    assert builder.stats.consolidations == 0
    assert any(c.compacted for c in calls)
    for n, call in enumerate(calls):
        assert call.input_tokens <= policy.budget_tokens
        if n == 0:
            continue  # warm-up: the first call has no previous call to share a prefix with
        assert call.reused_share >= 0.90, f"call {n} (compacted={call.compacted}) reused only {call.reused_share:.3f}"

    # Append-only: each call's frozen prefix (system + summaries) is a message-wise prefix of every later call.
    for earlier, later in zip(calls, calls[1:]):
        k = 1 + sum(1 for m in earlier.messages if m["content"].startswith("[Summary of earlier conversation"))
        assert later.messages[:k] == earlier.messages[:k]


def test_reuse_is_measured_on_bytes_not_claimed() -> None:
    builder = ContextBuilder("You are terse.", policy=CompactionPolicy(budget_tokens=2048), counter=ApproxTokenCounter())
    builder.add("user", "hello there, how are you today")
    first = builder.build()
    builder.add("assistant", "fine")
    builder.add("user", "good")
    second = builder.build()
    assert first.reused_tokens == 0
    rendered_first = [json.dumps(m, sort_keys=True) for m in first.messages]
    rendered_second = [json.dumps(m, sort_keys=True) for m in second.messages]
    assert rendered_second[: len(rendered_first)] == rendered_first
    assert second.reused_tokens == first.input_tokens
    assert 0 < second.reused_share < 1


def test_hard_budget_holds_with_huge_tool_output_and_consolidation() -> None:
    policy = CompactionPolicy(
        budget_tokens=1024, compact_at_tokens=300, keep_recent_tokens=120, summary_max_tokens=60,
        summaries_max_tokens=200, max_turn_tokens=400,
    )
    builder = ContextBuilder("You are a careful assistant.", policy=policy)
    for i in range(120):
        builder.add("user", f"Question {i}: what about item {i}? My code is {i * 7}.")
        builder.build()
        builder.add("tool", "row " * (3000 if i % 10 == 0 else 20))
        call = builder.build()
        assert call.input_tokens <= policy.budget_tokens
        builder.add("assistant", f"Answer {i}.")
    assert builder.stats.truncated_turns >= 10
    assert builder.stats.consolidations >= 1
    assert all(len(m["content"]) < 20_000 for m in call.messages)


def test_system_prompt_larger_than_budget_is_a_clear_error() -> None:
    with pytest.raises(ContextBudgetError, match="raise budget_tokens"):
        ContextBuilder("word " * 5000, policy=CompactionPolicy(budget_tokens=2048))


def test_tool_schema_key_order_does_not_change_the_prefix() -> None:
    tools = tool_schemas()
    reordered = [dict(reversed(list(t.items()))) for t in tools]
    a = ContextBuilder(SYSTEM_PROMPT, tools)
    b = ContextBuilder(SYSTEM_PROMPT, reordered)
    assert a.frozen_prefix() == b.frozen_prefix()


def test_state_round_trip_rebuilds_the_same_bytes() -> None:
    policy = CompactionPolicy(budget_tokens=6144)
    a = ContextBuilder(SYSTEM_PROMPT, tool_schemas(), policy=policy)
    _drive(a, 60)
    state = json.loads(json.dumps(a.to_state()))
    b = ContextBuilder(SYSTEM_PROMPT, tool_schemas(), policy=policy)
    b.restore(state)
    assert b.frozen_prefix() == a.frozen_prefix()
    a.add("user", "and one more thing")
    b.add("user", "and one more thing")
    ca, cb = a.build(), b.build()
    assert ca.messages == cb.messages
    assert cb.reused_share == ca.reused_share > 0.9


def test_extractive_summary_is_bounded_deterministic_and_keeps_facts() -> None:
    turns = [
        ("user", "Hi. My flight to Lisbon leaves on 14 March at 07:40. Keep it short."),
        ("assistant", "Noted. I will remind you the day before."),
        ("user", "The hotel is the Memmo Alfama, booking code QX-5521. Thanks!"),
        ("assistant", "Great, that is a lovely area. Anything else?"),
    ]
    counter = MiniLMTokenCounter()
    s1 = ExtractiveSummarizer().summarize(turns, max_tokens=40, counter=counter)
    s2 = ExtractiveSummarizer().summarize(turns, max_tokens=40, counter=counter)
    assert s1 == s2
    assert counter.count(s1) <= 40
    assert "QX-5521" in s1 or "14 March" in s1
