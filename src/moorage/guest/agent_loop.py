"""The built-in agent loop inside the sandbox (no code: a system prompt, tools and a model in moorage.toml): the model
asks for tools until it answers, every model and tool call a journaled step. Stdlib only."""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Dict, List, Optional

from .agent_context import AgentContext, StepFailed

MAX_TOOL_ROUNDS = 6

#: Corrections from the user's earlier turns that the built-in loop shows the model, most recent last.
MAX_CORRECTIONS_SHOWN = 5
#: Largest tool result (as JSON text) journaled and shown to the model; more is cut.
MAX_TOOL_RESULT = 128 * 1024
#: Largest text of a tool's exception shown to the model; more is cut.
MAX_TOOL_ERROR = 4000


async def _model_step(ctx: AgentContext, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]],
                      max_tokens: Optional[int]) -> Dict[str, Any]:
    """One model call as a journaled step: a replay returns the journaled output instead of asking again.

    A failed call is logged as a failed attempt but not settled, so a retry of the turn (same Idempotency-Key)
    asks the model again instead of replaying a passing outage.
    """
    seq = ctx._step_seq
    ctx._step_seq += 1
    begin = await ctx._host.call("durable.begin", {"seq": seq, "name": "model", "idempotency_key": None})
    if begin.get("replay"):
        if begin.get("error"):
            raise StepFailed("the model call failed for good earlier: %s" % begin["error"])
        return begin.get("result") or {}
    attempt = begin.get("attempt", 1)
    try:
        out = await ctx.llm.complete(messages, tools=tools, max_tokens=max_tokens)
    except Exception as e:  # noqa: BLE001 - logged as an attempt, then the turn fails as it would have
        try:
            # retries=attempt: the host records an attempt to be retried, never a final failure.
            await ctx._host.call("durable.fail", {"seq": seq, "name": "model", "attempt": attempt,
                                                  "error": "%s: %s" % (type(e).__name__, e), "retries": attempt})
        except Exception:  # noqa: BLE001 - the model's error is the one the caller must see
            pass
        raise
    await ctx._host.call("durable.complete", {"seq": seq, "name": "model", "idempotency_key": begin["idempotency_key"],
                                              "attempt": attempt, "result": out})
    return out


def _error_text(e: BaseException) -> str:
    """A tool's exception as the model reads it: its text cut to MAX_TOOL_ERROR (a huge one would be journaled and
    sent to the model whole, or be over the channel's frame), and said even when its ``str()`` itself raises."""
    try:
        text = str(e)
    except Exception as inner:  # noqa: BLE001 - the tool's own __str__
        text = "<its str() raised %s>" % type(inner).__name__
    return text if len(text) <= MAX_TOOL_ERROR else text[:MAX_TOOL_ERROR] + " [cut]"


def _tool_body(fn: Callable[..., Any], arguments: Dict[str, Any]) -> Callable[[], Any]:
    """The body of a tool's step: the tool's result as JSON values, or ``{"error": ...}`` when it raised (the
    model sees the failure and may try otherwise; the step itself succeeds, so nothing retries the tool)."""

    async def body() -> Any:
        try:
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # noqa: BLE001
            return {"error": "%s: %s" % (type(e).__name__, _error_text(e))}
        if isinstance(result, str):
            return result if len(result) <= MAX_TOOL_RESULT else result[:MAX_TOOL_RESULT] + " [cut]"
        text = json.dumps(result, default=str)
        if len(text) > MAX_TOOL_RESULT:
            return text[:MAX_TOOL_RESULT] + " [cut]"
        return json.loads(text)  # what the journal holds, so the live turn and its replay see the same

    return body


def _corrections_line(history: List[Dict[str, Any]]) -> str:
    """The user's recent corrections (earlier turns' first), as one short line for the new user turn ('' if none)."""
    notes = [str(e["note"]) for e in history if e.get("kind") in ("correction", "note") and e.get("note")]
    notes = [n if len(n) <= 300 else n[:300] + "..." for n in notes[-MAX_CORRECTIONS_SHOWN:]]
    return "[corrections from the user: %s]" % "; ".join(notes) if notes else ""


async def builtin_loop(ctx: AgentContext, message: str) -> str:
    """The no-code agent: the model asks for tools until it answers.

    Every model call and every tool call is a journaled step, so a turn recovered after a crash replays the
    model's outputs and the tools' results in order (the same path) and runs no tool a second time.
    """
    agent = ctx.agent
    schemas = agent.tool_schemas
    line = _corrections_line(await ctx.history())
    # Like known facts: in the new user turn, never in the stable prefix (system and tools stay byte-identical).
    messages = await ctx.memory.context("%s\n%s" % (line, message) if line else message,
                                        system=agent.manifest.get("system_prompt"), tools=schemas or None)
    out: Dict[str, Any] = {}
    for _ in range(MAX_TOOL_ROUNDS):
        out = await _model_step(ctx, messages, schemas or None, agent.manifest.get("max_tokens"))
        calls = out.get("tool_calls") or []
        if not calls:
            return out.get("text", "")
        messages.append({"role": "assistant", "content": out.get("text") or "", "tool_calls": calls})
        for call in calls:
            name = str(call.get("name", ""))
            fn = agent.tools.get(name)
            if fn is None:
                result: Any = {"error": "unknown tool %r" % name}
            else:
                result = await ctx.step("tool:" + name, _tool_body(fn, call.get("arguments") or {}), retries=0)
            await ctx.emit("tool", {"name": name, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "name": name,
                             "content": result if isinstance(result, str) else json.dumps(result, default=str)})
    return out.get("text", "")

