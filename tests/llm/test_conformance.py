"""The one suite every LLM provider must pass: embedded model, OpenAI-compatible and Anthropic
(the last two against real local HTTP servers speaking their wire formats, answered by the real model)."""

from __future__ import annotations

import pytest

from moorage.llm import (
    ChatRequest,
    Message,
    ModelNotFound,
    Provider,
    ResponseFormat,
    ToolSpec,
    collect,
)

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather for a city.",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def ask(text: str, **kw: object) -> ChatRequest:
    return ChatRequest([Message.system("You are a concise assistant."), Message.user(text)], temperature=0, **kw)  # type: ignore[arg-type]


async def test_plain_completion(provider: Provider) -> None:
    r = await provider.complete(ask("What is the capital of France?", max_tokens=8))
    assert r.text.strip()
    assert r.tool_calls == ()
    assert r.finish_reason in ("stop", "length")
    assert r.provider == provider.name
    assert r.model
    assert r.usage.input_tokens > 0
    assert 0 < r.usage.output_tokens <= 8


async def test_streaming_yields_the_same_answer_in_pieces(provider: Provider) -> None:
    req = ask("Name three colours.", max_tokens=8)
    chunks = [c async for c in provider.stream(req)]
    assert sum(1 for c in chunks if c.text) >= 2, "text should arrive in several deltas"
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None and last.usage.output_tokens > 0 and last.usage.input_tokens > 0
    assert all(c.finish_reason is None for c in chunks[:-1])
    whole = await provider.complete(req)
    assert "".join(c.text for c in chunks) == whole.text  # greedy decoding: same answer either way


async def test_tool_call_round_trip(provider: Provider) -> None:
    convo = [Message.user("What is the weather in Paris?")]
    first = await provider.complete(ChatRequest(convo, tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0))
    assert first.finish_reason == "tool_calls"
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0]
    assert call.name == "get_weather" and call.id
    assert isinstance(call.arguments.get("city"), str) and call.arguments["city"]

    convo += [first.as_message(), Message.tool_result(call, {"temperature_c": 18, "sky": "sunny"})]
    final = await provider.complete(ChatRequest(convo, tools=[WEATHER], tool_choice="auto", max_tokens=40, temperature=0))
    assert final.tool_calls == ()
    assert final.finish_reason in ("stop", "length")
    assert "18" in final.text, f"the answer should use the tool's result: {final.text!r}"


async def test_tool_call_streams_whole(provider: Provider) -> None:
    req = ChatRequest([Message.user("Weather in Rome?")], tools=[WEATHER], tool_choice="get_weather", max_tokens=40, temperature=0)
    chunks = [c async for c in provider.stream(req)]
    calls = [tc for c in chunks for tc in c.tool_calls]
    assert [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].arguments["city"], str)
    assert chunks[-1].finish_reason == "tool_calls"


async def test_json_schema_output(provider: Provider) -> None:
    r = await provider.complete(ask("Invent a person with a name and an age.", response_format=ResponseFormat(PERSON, "person"), max_tokens=40))
    doc = r.json()
    assert set(doc) == {"name", "age"}
    assert isinstance(doc["name"], str) and isinstance(doc["age"], int)
    assert r.tool_calls == ()


async def test_token_counting(provider: Provider) -> None:
    short = await provider.count_tokens("hello world")
    long = await provider.count_tokens("hello world, " * 20)
    assert 0 < short < long
    convo = [Message.system("You are a concise assistant."),
             Message.user("Explain in one sentence why the sky looks blue on a clear day at noon.")]
    counted = await provider.count_tokens(convo)
    reported = (await provider.complete(ChatRequest(convo, max_tokens=1))).usage.input_tokens
    if provider.capabilities.exact_token_count:
        assert counted == reported
    else:
        assert 0.5 <= counted / reported <= 2.0, (counted, reported)


async def test_repeated_prompt_reports_cached_input(provider: Provider) -> None:
    req = ask("List the planets of the solar system in order from the sun.", max_tokens=2)
    await provider.complete(req)
    again = await provider.complete(req)
    assert provider.capabilities.reports_cached_tokens
    assert 0 < again.usage.cached_input_tokens <= again.usage.input_tokens


async def test_unknown_model_is_model_not_found(provider: Provider) -> None:
    with pytest.raises(ModelNotFound) as e:
        await provider.complete(ChatRequest([Message.user("hi")], model="no-such-model", max_tokens=2))
    assert "no-such-model" in str(e.value)


async def test_collect_folds_a_stream(provider: Provider) -> None:
    r = await collect(provider.stream(ask("Say hello.", max_tokens=4)), provider=provider.name)
    assert r.text and r.usage.output_tokens > 0 and r.finish_reason in ("stop", "length")
