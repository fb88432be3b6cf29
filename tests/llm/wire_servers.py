"""Real local HTTP servers (127.0.0.1) speaking the OpenAI chat/completions and Anthropic Messages
wire formats, answered by the embedded model, with a script of canned replies for fault injection.

Written from the public API references, independently of the adapters they test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moorage.llm import EmbeddedProvider, Message, ResponseFormat, ToolCall, ToolSpec
from moorage.llm.types import ChatRequest, ChatResponse

MODEL = "smollm2-135m-instruct"


@dataclass
class Canned:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    #: Raw SSE text instead of a JSON body.
    sse: str | None = None


@dataclass
class Script:
    """Replies to send instead of asking the model, in order; and every request seen."""

    queue: deque[Canned] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def push(self, *replies: Canned) -> None:
        self.queue.extend(replies)

    def reset(self) -> None:
        self.queue.clear()
        self.requests.clear()


def _canned(c: Canned) -> Response:
    if c.sse is not None:
        return Response(c.sse, status_code=c.status, headers=c.headers, media_type="text/event-stream")
    return JSONResponse(c.body, status_code=c.status, headers=c.headers)


class _Backend:
    """The embedded model, created inside the server's own event loop."""

    def __init__(self) -> None:
        self._p: EmbeddedProvider | None = None

    @property
    def p(self) -> EmbeddedProvider:
        if self._p is None:
            self._p = EmbeddedProvider()
        return self._p


# --- OpenAI chat/completions -----------------------------------------------------------------


def openai_app(api_key: str, script: Script) -> Starlette:
    backend = _Backend()

    def to_request(body: dict[str, Any]) -> ChatRequest:
        names: dict[str, str] = {}
        msgs: list[Message] = []
        for m in body["messages"]:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [ToolCall(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
                names.update({c.id: c.name for c in calls})
                msgs.append(Message.assistant(m.get("content") or "", calls))
            elif m["role"] == "tool":
                msgs.append(Message("tool", m["content"], tool_call_id=m["tool_call_id"], name=names.get(m["tool_call_id"])))
            else:
                msgs.append(Message(m["role"], m.get("content") or ""))
        tools = [ToolSpec(t["function"]["name"], t["function"].get("description", ""), t["function"].get("parameters") or {}) for t in body.get("tools") or ()]
        choice = body.get("tool_choice", "auto")
        if isinstance(choice, dict):
            choice = choice["function"]["name"]
        rf = body.get("response_format")
        return ChatRequest(
            msgs,
            tools=tools,
            tool_choice=choice if tools else "auto",
            response_format=ResponseFormat(rf["json_schema"]["schema"], rf["json_schema"].get("name", "response")) if rf and rf.get("type") == "json_schema" else None,
            max_tokens=body.get("max_tokens") or body.get("max_completion_tokens"),
            temperature=body.get("temperature"),
            stop=body.get("stop") or (),
        )

    def usage(u: Any) -> dict[str, Any]:
        return {
            "prompt_tokens": u.input_tokens,
            "completion_tokens": u.output_tokens,
            "total_tokens": u.input_tokens + u.output_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
        }

    def wire_calls(r: ChatResponse) -> list[dict[str, Any]]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in r.tool_calls]

    async def chat(request: Request) -> Response:
        body = await request.json()
        script.requests.append({"headers": dict(request.headers), "body": body})
        if request.headers.get("authorization") != f"Bearer {api_key}":
            given = request.headers.get("authorization", "").removeprefix("Bearer ")
            # Like the real API, echo the key that was sent (the adapter must redact it).
            return JSONResponse({"error": {"message": f"Incorrect API key provided: {given}.", "type": "invalid_request_error", "code": "invalid_api_key"}}, status_code=401)
        if script.queue:
            return _canned(script.queue.popleft())
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist or you do not have access to it.", "type": "invalid_request_error", "code": "model_not_found"}}, status_code=404)
        req = to_request(body)
        cid = "chatcmpl-" + uuid.uuid4().hex[:20]
        if not body.get("stream"):
            r = await backend.p.complete(req)
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text or None, **({"tool_calls": wire_calls(r)} if r.tool_calls else {})}, "finish_reason": r.finish_reason}],
                "usage": usage(r.usage),
            })

        async def events() -> Any:
            def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
                doc = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                return f"data: {json.dumps(doc)}\n\n"

            yield chunk({"role": "assistant", "content": ""})
            final = None
            async for c in backend.p.stream(req):
                if c.text:
                    yield chunk({"content": c.text})
                for i, call in enumerate(c.tool_calls):
                    # Tool calls arrive in fragments: id and name first, then the arguments in pieces.
                    args = json.dumps(call.arguments)
                    half = len(args) // 2
                    yield chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]})
                    yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[:half]}}]})
                    yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[half:]}}]})
                if c.finish_reason:
                    final = c
            assert final is not None
            yield chunk({}, final.finish_reason)
            if (body.get("stream_options") or {}).get("include_usage"):
                doc = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL, "choices": [], "usage": usage(final.usage)}
                yield f"data: {json.dumps(doc)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


# --- Anthropic Messages ----------------------------------------------------------------------


def anthropic_app(api_key: str, script: Script) -> Starlette:
    backend = _Backend()
    stop_reason = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

    def err(status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)

    def to_messages(body: dict[str, Any]) -> list[Message]:
        system = body.get("system") or ""
        if isinstance(system, list):
            system = "\n".join(b["text"] for b in system)
        msgs: list[Message] = [Message.system(system)] if system else []
        names: dict[str, str] = {}
        for m in body["messages"]:
            blocks = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            if m["role"] == "assistant":
                calls = [ToolCall(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
                names.update({c.id: c.name for c in calls})
                msgs.append(Message.assistant(text, calls))
                continue
            for b in blocks:
                if b["type"] == "tool_result":
                    content = b["content"] if isinstance(b["content"], str) else "".join(x["text"] for x in b["content"])
                    msgs.append(Message("tool", content, tool_call_id=b["tool_use_id"], name=names.get(b["tool_use_id"])))
            if text:
                msgs.append(Message.user(text))
        return msgs

    def tools_of(body: dict[str, Any]) -> list[ToolSpec]:
        return [ToolSpec(t["name"], t.get("description", ""), t["input_schema"]) for t in body.get("tools") or ()]

    def check(request: Request) -> Response | None:
        if request.headers.get("x-api-key") != api_key:
            return err(401, "authentication_error", "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return err(400, "invalid_request_error", "anthropic-version: header is required")
        return None

    def usage(u: Any) -> dict[str, Any]:
        # The Messages API counts cache reads apart from input_tokens.
        return {"input_tokens": u.input_tokens - u.cached_input_tokens, "output_tokens": u.output_tokens,
                "cache_read_input_tokens": u.cached_input_tokens, "cache_creation_input_tokens": 0}

    async def messages(request: Request) -> Response:
        body = await request.json()
        script.requests.append({"headers": dict(request.headers), "body": body})
        if (bad := check(request)) is not None:
            return bad
        if script.queue:
            return _canned(script.queue.popleft())
        if body.get("model") != MODEL:
            return err(404, "not_found_error", f"model: {body.get('model')}")
        if "max_tokens" not in body:
            return err(400, "invalid_request_error", "max_tokens: Field required")
        tools = tools_of(body)
        tc = body.get("tool_choice") or {"type": "auto"}
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc["type"], tc.get("name", "auto"))
        req = ChatRequest(to_messages(body), tools=tools, tool_choice=choice if tools else "auto", max_tokens=body["max_tokens"],
                          temperature=body.get("temperature"), stop=body.get("stop_sequences") or ())
        mid = "msg_" + uuid.uuid4().hex[:20]

        def tool_id(c: ToolCall) -> str:
            return "toolu_" + c.id.removeprefix("call_")

        if not body.get("stream"):
            r = await backend.p.complete(req)
            content = ([{"type": "text", "text": r.text}] if r.text else []) + [
                {"type": "tool_use", "id": tool_id(c), "name": c.name, "input": c.arguments} for c in r.tool_calls]
            return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": MODEL, "content": content,
                                 "stop_reason": stop_reason[r.finish_reason], "stop_sequence": None, "usage": usage(r.usage)})

        async def events() -> Any:
            def ev(name: str, doc: dict[str, Any]) -> str:
                return f"event: {name}\ndata: {json.dumps(dict(doc, type=name))}\n\n"

            chunks = [c async for c in backend.p.stream(req)]
            final = chunks[-1]
            u = usage(final.usage)
            yield ev("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "model": MODEL, "content": [],
                                                   "stop_reason": None, "stop_sequence": None,
                                                   "usage": dict(u, output_tokens=1)}})
            yield ev("ping", {})
            index = 0
            texts = [c.text for c in chunks if c.text]
            if texts:
                yield ev("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                for t in texts:
                    yield ev("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": t}})
                yield ev("content_block_stop", {"index": index})
                index += 1
            for c in [call for ch in chunks for call in ch.tool_calls]:
                yield ev("content_block_start", {"index": index, "content_block": {"type": "tool_use", "id": tool_id(c), "name": c.name, "input": {}}})
                args = json.dumps(c.arguments)
                for piece in (args[: len(args) // 2], args[len(args) // 2:]):
                    yield ev("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})
                yield ev("content_block_stop", {"index": index})
                index += 1
            yield ev("message_delta", {"delta": {"stop_reason": stop_reason[final.finish_reason or "stop"], "stop_sequence": None},
                                       "usage": {"output_tokens": u["output_tokens"]}})
            yield ev("message_stop", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def count_tokens(request: Request) -> Response:
        body = await request.json()
        script.requests.append({"headers": dict(request.headers), "body": body})
        if (bad := check(request)) is not None:
            return bad
        return JSONResponse({"input_tokens": await backend.p.count_tokens(to_messages(body), tools_of(body))})

    return Starlette(routes=[
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ])


# --- running one in a thread -----------------------------------------------------------------


class WireServer:
    """A uvicorn server on 127.0.0.1 (free port) in a background thread."""

    def __init__(self, make_app: Callable[[str, Script], Starlette], api_key: str) -> None:
        self.script = Script()
        config = uvicorn.Config(make_app(api_key, self.script), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "WireServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test wire server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
