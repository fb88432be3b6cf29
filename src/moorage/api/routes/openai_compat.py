"""The OpenAI-compatible facade: ``POST /v1/chat/completions`` (and streaming) and ``GET /v1/models``.

``model`` names the agent. Only the last user message is the new turn: the agent keeps its own memory,
so the history a client resends is not replayed. The end-user comes from an end-user token, or, for a
tenant key with the invoke scope, from the ``user`` field or the ``X-Moorage-User`` header.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.invoke_shared import entity_for, replay_headers, run_turn, stream_turn
from moorage.api.routes.executions import announce_interrupt, enforce_caps
from moorage.api.routing import Call, Endpoint, Reply
from moorage.api.problem import openai_error
from moorage.api.sse import error_payload
from moorage.errors import InvalidInput


def last_user_message(messages: Any) -> str:
    """The text of the last ``user`` message (string content, or the text parts of a content list)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages must be a non-empty list", hint="send at least one {role: user, content: ...}")
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "\n".join(p.get("text", "") for p in content
                             if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
        else:
            text = ""
        if text.strip():
            return text
        raise InvalidInput("the last user message has no text", hint="send its content as a string or text parts")
    raise InvalidInput("no user message in messages", hint="the last message with role 'user' is the new turn")


def usage_block(usage: dict[str, Any]) -> dict[str, int]:
    prompt = int(usage.get("input_tokens", 0) or 0)
    completion = int(usage.get("output_tokens", 0) or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def reply_text(reply: Any) -> str:
    """A turn's reply as a message's content, which is text: an agent's JSON reply (a dict, a list) as JSON."""
    if reply is None:
        return ""
    return reply if isinstance(reply, str) else json.dumps(reply, default=str)


def completion(agent: str, result: Any) -> dict[str, Any]:
    """A chat.completion object from a runtime TurnResult."""
    content = reply_text(result.reply)
    return {
        "id": f"chatcmpl-{result.turn_id}", "object": "chat.completion", "created": int(time.time()), "model": agent,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": usage_block(dict(getattr(result, "usage", None) or {})),
        # Not in OpenAI's schema; clients ignore it. A waiting turn carries its interrupt here.
        "moorage": {"status": result.status, "interrupt": result.interrupt, "trace_id": result.trace_id,
                    "run_id": getattr(result, "run_id", None)},
    }


def chunk(chunk_id: str, agent: str, delta: dict[str, Any], finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": agent, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def token_text(data: Any) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        if "data" in data:  # the runtime wraps guest events as {"event": ..., "data": ...}
            return token_text(data["data"])
        for k in ("text", "token", "content", "delta"):
            if isinstance(data.get(k), str):
                return data[k]
    return ""


async def chat_completions(call: Call) -> Any:
    agent = call.field("model", str)
    user = call.field("user", str, required=False) or call.request.headers.get("x-moorage-user")
    session = call.request.headers.get("x-moorage-session")
    if call.who.user is not None:
        user = None  # an end-user token names its own user; a body field cannot change it
    entity = entity_for(call, agent, user, session)
    message = last_user_message((call.body or {}).get("messages"))
    await enforce_caps(call, entity)
    if not call.field("stream", bool, required=False, default=False):
        result = await run_turn(call, entity, message)
        await run_in_threadpool(announce_interrupt, call, result)  # a turn waiting for a human is a webhook event
        return Reply(completion(agent, result), 200, replay_headers(result))

    chunk_id = f"chatcmpl-{call.trace_id}"
    events = await stream_turn(call, entity, message)

    async def frames() -> AsyncIterator[bytes]:
        yield chunk(chunk_id, agent, {"role": "assistant", "content": ""})
        streamed = False
        try:
            async for ev in events:
                if ev.kind == "token":
                    text = token_text(ev.data)
                    if text:
                        streamed = True
                        yield chunk(chunk_id, agent, {"content": text})
                elif ev.kind == "done":
                    result = ev.data
                    await run_in_threadpool(announce_interrupt, call, result)
                    # An agent that returns its reply whole (no token events) still reaches the client.
                    text = reply_text(getattr(result, "reply", None))
                    if not streamed and text:
                        yield chunk(chunk_id, agent, {"content": text})
                    usage = dict(getattr(result, "usage", None) or {})
                    yield chunk(chunk_id, agent, {}, "stop", usage_block(usage))
                elif ev.kind == "error":
                    yield f"data: {json.dumps({'error': _in_band(ev.data)})}\n\n".encode()
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield f"data: {json.dumps({'error': _in_band(error_payload(e, call.trace_id))})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    from moorage.api.sse import event_stream

    return event_stream(frames(), call.trace_id, keepalive_s=call.ctx.config.sse_keepalive_s)


def _in_band(payload: Any) -> Any:
    """A stream's error, with OpenAI's ``message`` and ``code`` beside moorage's members (the official clients raise
    it with that message; without one they said "An error occurred during streaming")."""
    if not isinstance(payload, dict):
        return payload
    return {**openai_error(payload), **payload, "message": openai_error(payload)["message"]}


def list_models(call: Call) -> dict[str, Any]:
    # A model is an agent a completion can run: one whose deploys all failed (or not built yet) is none yet.
    agents = [a for a in call.tenant.agents.list() if a.live_deployment]
    if call.who.agent is not None:
        agents = [a for a in agents if a.name == call.who.agent]
    return {"object": "list", "data": [{"id": a.name, "object": "model", "created": int(a.created_at),
                                        "owned_by": "moorage"} for a in agents]}


_MESSAGE = {"type": "object", "properties": {"role": S.STR, "content": {"type": ["string", "array", "null"]}},
            "required": ["role"]}

ENDPOINTS = [
    Endpoint("POST", "/v1/chat/completions", chat_completions, "OpenAI-compatible chat completion (model = agent)",
             "openai", "createChatCompletion", scope="invoke", end_user=True, agent_checked=True, streams=True, idempotency="runtime",
             body=S.obj({"model": S.ID, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                         "stream": {"type": "boolean"}, "user": S.ID}, ["model", "messages"]),
             response=S.obj({"id": S.STR, "object": S.STR, "created": S.INT, "model": S.STR,
                             "choices": {"type": "array", "items": S.obj({
                                 "index": S.INT, "message": S.obj({"role": S.STR, "content": S.STR}),
                                 "finish_reason": S.NSTR, "logprobs": {"type": "null"}})},
                             "usage": S.obj({"prompt_tokens": S.INT, "completion_tokens": S.INT,
                                             "total_tokens": S.INT}),
                             # moorage's own: the turn's status, its question while it waits, its trace and run.
                             "moorage": S.obj({"status": {"enum": ["done", "waiting"]}, "interrupt": S.ANY,
                                               "trace_id": S.NSTR, "run_id": S.NSTR})},
                            ["id", "object", "choices"])),
    Endpoint("GET", "/v1/models", list_models, "OpenAI-compatible model list (one model per agent with a live deployment)", "openai",
             "listModels", scope="invoke", also_scopes=("read",), end_user=True, agent_checked=True,
             response=S.obj({"object": S.STR, "data": {"type": "array", "items": S.obj({
                 "id": S.STR, "object": S.STR, "created": S.INT, "owned_by": S.STR})}})),
]
