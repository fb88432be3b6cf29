"""Adapter for the Anthropic Messages API (``POST /v1/messages``), plain and streamed.

Maps tool calls to ``tool_use``/``tool_result`` content blocks and JSON-schema output to a forced tool.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Sequence

import httpx

from moorage.errors import InvalidInput
from moorage.llm import _http
from moorage.llm.errors import BadToolCall, ProviderError, ProviderUnavailable, RateLimited
from moorage.llm.estimate import estimate_tokens
from moorage.llm.provider import Capabilities, whole_as_chunks
from moorage.llm.secret import Secret
from moorage.llm.types import (
    ChatChunk,
    ChatRequest,
    ChatResponse,
    FinishReason,
    Message,
    ToolCall,
    ToolSpec,
    Usage,
)
from moorage.log import get_logger

log = get_logger(__name__)

API_VERSION = "2023-06-01"
#: The Messages API requires max_tokens; used when a request leaves it unset.
DEFAULT_MAX_TOKENS = 1024
#: Name of the tool that carries JSON-schema output (Anthropic's documented pattern for structured output).
JSON_TOOL = "json_response"

_STOP: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
}


class AnthropicProvider:
    capabilities = Capabilities(exact_token_count=False)

    def __init__(
        self,
        api_key: str | Secret,
        default_model: str = "claude-sonnet-4-5",
        *,
        base_url: str = "https://api.anthropic.com",
        name: str = "anthropic",
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.default_model = default_model
        self._key = api_key if isinstance(api_key, Secret) else Secret(api_key)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)
        # None: not probed yet; False: this server has no count_tokens endpoint, estimate instead.
        self._count_endpoint: bool | None = None

    def __repr__(self) -> str:
        return f"AnthropicProvider(name={self.name!r}, base_url={self.base_url!r}, model={self.default_model!r}, api_key=***)"

    # --- wire format -------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"x-api-key": self._key.reveal(), "anthropic-version": API_VERSION, "content-type": "application/json"}

    def _prompt(self, messages: Sequence[Message], tools: Sequence[ToolSpec], model: str) -> dict[str, Any]:
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        body: dict[str, Any] = {"model": model, "messages": _wire_messages([m for m in messages if m.role != "system"])}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [{"name": t.name, "description": t.description, "input_schema": dict(t.parameters)} for t in tools]
        return body

    def _body(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        tools = list(request.tools)
        choice = request.tool_choice
        if request.response_format is not None:
            if tools:
                raise InvalidInput(
                    "the Anthropic adapter cannot combine response_format with tools",
                    hint="ask for the JSON in a second call without tools, or describe it as a tool",
                )
            tools = [ToolSpec(JSON_TOOL, "Reply with the answer as this JSON object.", request.response_format.schema)]
            choice = JSON_TOOL
        body = self._prompt(request.messages, tools, request.model or self.default_model)
        body["max_tokens"] = request.max_tokens or DEFAULT_MAX_TOKENS
        if tools:
            if choice == "auto":
                body["tool_choice"] = {"type": "auto"}
            elif choice == "none":
                body["tool_choice"] = {"type": "none"}
            elif choice == "required":
                body["tool_choice"] = {"type": "any"}
            else:
                body["tool_choice"] = {"type": "tool", "name": choice}
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop_sequences"] = list(request.stop)
        if stream:
            body["stream"] = True
        return body

    # --- Provider ----------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> ChatResponse:
        model = request.model or self.default_model
        started = time.perf_counter()
        doc = await _http.post_json(self._client, "/v1/messages", self._body(request, False), self._headers(),
                                    provider=self.name, base_url=self.base_url, secret=self._key, model=model)
        return self._response(doc, request, model, started)

    def _response(self, doc: Any, request: ChatRequest, model: str, started: float) -> ChatResponse:
        if not isinstance(doc, dict):
            raise ProviderError(f"{self.name} answered without content: {str(doc)[:200]}", provider=self.name)
        text: list[str] = []
        calls: list[ToolCall] = []
        for block in doc.get("content") or ():
            if block.get("type") == "text":
                text.append(block.get("text", ""))
            elif block.get("type") == "tool_use":
                calls.append(self._tool_call(block.get("id", ""), block.get("name", ""), block.get("input"), request))
        text_out, calls_out, finish = self._finish(request, "".join(text), calls, doc.get("stop_reason"))
        return ChatResponse(
            text=text_out,
            tool_calls=calls_out,
            finish_reason=finish,
            usage=_usage(doc.get("usage")),
            model=doc.get("model") or model,
            provider=self.name,
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    async def stream(self, request: ChatRequest) -> AsyncIterator[ChatChunk]:
        model = request.model or self.default_model
        json_mode = request.response_format is not None
        try:
            async with self._client.stream("POST", "/v1/messages", json=self._body(request, True), headers=self._headers()) as r:
                if r.status_code >= 400:
                    _http.raise_for_status(self.name, r, await r.aread(), self._key, model)
                if _http.answered_whole(r):  # a compatible server that ignores "stream": true
                    whole = self._response(_http.parse_json(self.name, await r.aread()), request, model, time.perf_counter())
                    for chunk in whole_as_chunks(whole):
                        yield chunk
                    return
                blocks: dict[int, dict[str, Any]] = {}
                start_usage: dict[str, Any] = {}
                output_tokens = 0
                stop_reason = None
                seen_model = model
                async for event, data in _http.sse_events(r):
                    doc = _http.parse_json(self.name, data)
                    kind = doc.get("type", event)
                    if kind == "message_start":
                        msg = doc.get("message") or {}
                        seen_model = msg.get("model") or seen_model
                        start_usage = msg.get("usage") or {}
                    elif kind == "content_block_start":
                        blocks[doc["index"]] = dict(doc.get("content_block") or {}, partial="")
                    elif kind == "content_block_delta":
                        delta = doc.get("delta") or {}
                        if delta.get("type") == "text_delta" and delta.get("text"):
                            yield ChatChunk(text=delta["text"], model=seen_model)
                        elif delta.get("type") == "input_json_delta":
                            blocks[doc["index"]]["partial"] += delta.get("partial_json", "")
                    elif kind == "content_block_stop":
                        block = blocks.get(doc["index"]) or {}
                        if block.get("type") == "tool_use":
                            raw = block["partial"] or "{}"
                            try:
                                args = json.loads(raw)
                            except ValueError:
                                raise BadToolCall(f"{self.name} streamed tool input that is not JSON: {raw[:200]!r}", provider=self.name) from None
                            if json_mode and block.get("name") == JSON_TOOL:
                                yield ChatChunk(text=json.dumps(args), model=seen_model)
                            else:
                                yield ChatChunk(tool_calls=(self._tool_call(block.get("id", ""), block.get("name", ""), args, request),), model=seen_model)
                    elif kind == "message_delta":
                        stop_reason = (doc.get("delta") or {}).get("stop_reason") or stop_reason
                        output_tokens = int((doc.get("usage") or {}).get("output_tokens") or output_tokens)
                    elif kind == "error":
                        err = doc.get("error") or {}
                        message = self._key.redact(str(err.get("message", data))[:300])
                        if err.get("type") in ("overloaded_error", "api_error"):
                            raise ProviderUnavailable(f"{self.name} failed mid-stream: {message}", provider=self.name)
                        if err.get("type") == "rate_limit_error":
                            raise RateLimited(f"{self.name} rate-limited mid-stream: {message}", provider=self.name)
                        raise ProviderError(f"{self.name} failed mid-stream: {message}", provider=self.name)
                    elif kind == "message_stop":
                        break
        except httpx.TransportError as e:
            raise _http.connection_error(self.name, self.base_url, e) from None
        usage = _usage(dict(start_usage, output_tokens=output_tokens or start_usage.get("output_tokens", 0)))
        finish = _STOP.get(stop_reason or "end_turn", "stop")
        if json_mode and finish == "tool_calls":
            finish = "stop"
        yield ChatChunk(finish_reason=finish, usage=usage, model=seen_model)

    async def count_tokens(self, messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
        """Exact count from ``/v1/messages/count_tokens`` when the server has it, else an estimate."""
        if isinstance(messages, str):
            messages = [Message.user(messages)]
        if self._count_endpoint is not False:
            try:
                r = await self._client.post(
                    "/v1/messages/count_tokens", json=self._prompt(messages, tools, self.default_model), headers=self._headers()
                )
            except httpx.TransportError as e:
                raise _http.connection_error(self.name, self.base_url, e) from None
            if r.status_code in (404, 405):
                self._count_endpoint = False  # compatible servers often lack it; do not ask again
            else:
                _http.raise_for_status(self.name, r, r.content, self._key, self.default_model)
                self._count_endpoint = True
                return int(_http.parse_json(self.name, r.content)["input_tokens"])
        return estimate_tokens(messages, tools)

    async def aclose(self) -> None:
        await self._client.aclose()

    # --- helpers -----------------------------------------------------------------------

    def _tool_call(self, call_id: str, name: str, args: Any, request: ChatRequest) -> ToolCall:
        known = {t.name for t in request.tools} | ({JSON_TOOL} if request.response_format is not None else set())
        if name not in known:
            raise BadToolCall(f"{self.name} model called unknown tool {name!r} (offered: {sorted(known)})", provider=self.name)
        if not isinstance(args, dict):
            raise BadToolCall(f"{self.name} model sent tool input that is not an object: {str(args)[:200]!r}", provider=self.name)
        return ToolCall(id=call_id, name=name, arguments=args)

    def _finish(
        self, request: ChatRequest, text: str, calls: list[ToolCall], stop_reason: str | None
    ) -> tuple[str, tuple[ToolCall, ...], FinishReason]:
        finish = _STOP.get(stop_reason or "end_turn", "stop")
        if request.response_format is not None:
            # The forced tool's input *is* the structured answer.
            for c in calls:
                if c.name == JSON_TOOL:
                    return json.dumps(c.arguments), (), "stop" if finish == "tool_calls" else finish
        return text, tuple(calls), "tool_calls" if calls else finish


def _wire_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Content-block messages; tool results ride in user turns, and same-role turns are merged."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            role, blocks = "user", [{"type": "tool_result", "tool_use_id": m.tool_call_id or "", "content": m.content}]
        elif m.role == "assistant":
            role = "assistant"
            blocks = [{"type": "text", "text": m.content}] if m.content else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in m.tool_calls]
        else:
            role, blocks = "user", [{"type": "text", "text": m.content}]
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    return out


def _usage(doc: Any) -> Usage:
    if not isinstance(doc, dict):
        return Usage()
    # Anthropic's input_tokens excludes cache reads and writes; ours counts every prompt token.
    cached = int(doc.get("cache_read_input_tokens") or 0)
    created = int(doc.get("cache_creation_input_tokens") or 0)
    return Usage(
        input_tokens=int(doc.get("input_tokens") or 0) + cached + created,
        output_tokens=int(doc.get("output_tokens") or 0),
        cached_input_tokens=cached,
    )
