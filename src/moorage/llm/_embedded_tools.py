"""How the embedded small model calls tools: the tools are described in the system prompt and the
output is *constrained* by a JSON schema (llama.cpp grammar), so a call is always well formed.

The model answers ``{"tool": <one of the tool names>, "arguments": {...}}`` or, when it may
choose, ``{"answer": "..."}``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Sequence

from moorage.llm.errors import BadToolCall
from moorage.llm.types import ChatRequest, Message, ToolCall, ToolSpec


def tools_active(request: ChatRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def offered(request: ChatRequest) -> list[ToolSpec]:
    if request.tool_choice in ("auto", "required"):
        return list(request.tools)
    return [t for t in request.tools if t.name == request.tool_choice]


def instructions(tools: Sequence[ToolSpec], may_answer: bool, after_result: bool = False) -> str:
    lines = ["You can call these tools:"]
    for t in tools:
        lines.append(f"- {t.name}: {t.description or 'no description'} Arguments (JSON schema): {json.dumps(t.parameters)}")
    lines.append('To call a tool, reply with a JSON object {"tool": <tool name>, "arguments": {...}}.')
    if may_answer:
        lines.append('To answer directly, reply with {"answer": <your answer>}.')
    if may_answer and after_result:
        # Without this nudge the small model tends to repeat the call it just got the result of.
        lines.append("You already have the tool results you asked for: use them in your answer.")
    return "\n".join(lines)


def output_schema(request: ChatRequest) -> dict[str, Any]:
    """The JSON schema the model's reply is constrained to."""
    branches: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"tool": {"const": t.name}, "arguments": _object_schema(t.parameters)},
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        }
        for t in offered(request)
    ]
    if request.tool_choice == "auto":
        answer = dict(request.response_format.schema) if request.response_format else {"type": "string"}
        branches.append({"type": "object", "properties": {"answer": answer}, "required": ["answer"], "additionalProperties": False})
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _object_schema(schema: Any) -> dict[str, Any]:
    out = dict(schema) if isinstance(schema, dict) else {}
    out.setdefault("type", "object")
    return out


def render(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Plain chat-template messages for SmolLM2, whose template has no tool role it understands.

    A past tool call is written as a sentence, not as the JSON the model emitted: shown its own
    JSON, the small model copies it instead of answering. A tool result becomes a user turn.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"{m.name or 'The tool'} returned: {m.content}"})
        elif m.role == "assistant" and m.tool_calls:
            said = " ".join(f"I will call {c.name} with {json.dumps(c.arguments)}." for c in m.tool_calls)
            out.append({"role": "assistant", "content": (m.content + " " + said) if m.content else said})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def already_answered(messages: Sequence[Message], call: ToolCall) -> bool:
    """True if the same call (name and arguments) got a result since the last user message."""
    answered: set[str] = set()
    for m in reversed(messages):
        if m.role == "user":
            return False
        if m.role == "tool" and m.tool_call_id:
            answered.add(m.tool_call_id)
        if m.role == "assistant":
            for c in m.tool_calls:
                if c.id in answered and c.name == call.name and c.arguments == call.arguments:
                    return True
    return False


def with_instructions(rendered: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    if rendered and rendered[0]["role"] == "system":
        return [{"role": "system", "content": rendered[0]["content"] + "\n\n" + text}] + rendered[1:]
    return [{"role": "system", "content": text}] + rendered


def parse(request: ChatRequest, text: str, truncated: bool) -> tuple[str, tuple[ToolCall, ...]]:
    """(answer text, tool calls) from the constrained reply."""
    try:
        doc = json.loads(text)
    except ValueError:
        partial = _partial_answer(text) if truncated else None
        if partial is not None:
            return partial, ()  # a direct answer cut off by max_tokens: keep what was said
        raise BadToolCall(
            f"the embedded model's tool reply is not complete JSON: {text[:200]!r}",
            provider="embedded",
            hint="raise max_tokens (a tool call needs room for its arguments)" if truncated else None,
        ) from None
    if "tool" in doc:
        call = ToolCall(id="call_" + uuid.uuid4().hex[:24], name=doc["tool"], arguments=doc.get("arguments") or {})
        return "", (call,)
    answer = doc.get("answer", "")
    return (answer if isinstance(answer, str) else json.dumps(answer)), ()


_ANSWER_START = re.compile(r'^\s*\{\s*"answer"\s*:\s*"')


def _partial_answer(text: str) -> str | None:
    m = _ANSWER_START.match(text)
    if not m:
        return None
    rest = text[m.end():]
    while rest:
        try:
            return str(json.loads('"' + rest + '"'))
        except ValueError:
            rest = rest[:-1]  # drop a half-written escape sequence at the cut
    return ""
