"""Adapter for OpenAI-compatible chat/completions servers (OpenAI, vLLM, llama.cpp server, Ollama).

Speaks JSON and SSE over httpx; reports ``usage.prompt_tokens_details.cached_tokens`` as cached input.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Sequence

import httpx

from moorage.llm import _http
from moorage.llm.errors import BadToolCall, ProviderError
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

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}


class OpenAICompatibleProvider:
    """``POST {base_url}/chat/completions`` with a Bearer key; ``base_url`` ends in ``/v1`` for most servers."""

    capabilities = Capabilities(exact_token_count=False)

    def __init__(
        self,
        base_url: str,
        api_key: str | Secret = "",
        default_model: str = "",
        *,
        name: str = "openai",
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.default_model = default_model
        self._key = api_key if isinstance(api_key, Secret) else Secret(api_key)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)

    def __repr__(self) -> str:
        return f"OpenAICompatibleProvider(name={self.name!r}, base_url={self.base_url!r}, model={self.default_model!r}, api_key=***)"

    # --- wire format -------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self._key:
            h["authorization"] = f"Bearer {self._key.reveal()}"
        return h

    def _body(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model or self.default_model,
            "messages": [_wire_message(m) for m in request.messages],
        }
        if request.tools:
            body["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}}
                for t in request.tools
            ]
            if request.tool_choice in ("auto", "none", "required"):
                body["tool_choice"] = request.tool_choice
            else:
                body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice}}
        if request.response_format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": request.response_format.name, "schema": dict(request.response_format.schema), "strict": True},
            }
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop"] = list(request.stop)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    # --- Provider ----------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> ChatResponse:
        model = request.model or self.default_model
        started = time.perf_counter()
        doc = await _http.post_json(self._client, "/chat/completions", self._body(request, False), self._headers(),
                                    provider=self.name, base_url=self.base_url, secret=self._key, model=model)
        return self._response(doc, request, model, started)

    def _response(self, doc: Any, request: ChatRequest, model: str, started: float) -> ChatResponse:
        try:
            choice = doc["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ProviderError(f"{self.name} answered without choices: {str(doc)[:200]}", provider=self.name) from None
        calls = tuple(_parse_call(self.name, c["id"], c["function"]["name"], c["function"].get("arguments") or "{}", request) for c in msg.get("tool_calls") or ())
        return ChatResponse(
            text=msg.get("content") or "",
            tool_calls=calls,
            finish_reason="tool_calls" if calls else _FINISH.get(choice.get("finish_reason") or "stop", "stop"),
            usage=usage_from_wire(doc.get("usage")),
            model=doc.get("model") or model,
            provider=self.name,
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    async def stream(self, request: ChatRequest) -> AsyncIterator[ChatChunk]:
        model = request.model or self.default_model
        try:
            async with self._client.stream("POST", "/chat/completions", json=self._body(request, True), headers=self._headers()) as r:
                if r.status_code >= 400:
                    _http.raise_for_status(self.name, r, await r.aread(), self._key, model)
                if _http.answered_whole(r):
                    whole = self._response(_http.parse_json(self.name, await r.aread()), request, model, time.perf_counter())
                    for chunk in whole_as_chunks(whole):
                        yield chunk
                    return
                # Tool-call deltas arrive as fragments keyed by index; emit each call once it is whole.
                pending: dict[int, dict[str, str]] = {}
                finish: FinishReason | None = None
                usage: Usage | None = None
                seen_model = model
                async for _event, data in _http.sse_events(r):
                    if data.strip() == "[DONE]":
                        break
                    doc = _http.parse_json(self.name, data)
                    if isinstance(doc, dict) and "error" in doc:
                        msg, _ = _http.upstream_message(data.encode(), self._key)
                        raise ProviderError(f"{self.name} failed mid-stream: {msg}", provider=self.name)
                    seen_model = doc.get("model") or seen_model
                    if doc.get("usage"):
                        usage = usage_from_wire(doc["usage"])
                    for choice in doc.get("choices") or ():
                        delta = choice.get("delta") or {}
                        for tc in delta.get("tool_calls") or ():
                            slot = pending.setdefault(tc.get("index", 0), {"id": "", "name": "", "arguments": ""})
                            fn = tc.get("function") or {}
                            slot["id"] = tc.get("id") or slot["id"]
                            slot["name"] += fn.get("name") or ""
                            slot["arguments"] += fn.get("arguments") or ""
                        if delta.get("content"):
                            yield ChatChunk(text=delta["content"], model=seen_model)
                        if choice.get("finish_reason"):
                            finish = _FINISH.get(choice["finish_reason"], "stop")
        except httpx.TransportError as e:
            raise _http.connection_error(self.name, self.base_url, e) from None
        calls = tuple(_parse_call(self.name, s["id"], s["name"], s["arguments"] or "{}", request) for _, s in sorted(pending.items()))
        yield ChatChunk(
            tool_calls=calls,
            finish_reason="tool_calls" if calls else (finish or "stop"),
            usage=usage or Usage(),
            model=seen_model,
        )

    async def count_tokens(self, messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
        # The chat/completions API has no counting endpoint, and tokenizer files are not available
        # offline for every compatible server: estimate (see moorage.llm.estimate).
        return estimate_tokens(messages, tools)

    async def aclose(self) -> None:
        await self._client.aclose()


def _wire_message(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content}
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["content"] = m.content or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in m.tool_calls
        ]
    return out


def usage_from_wire(doc: Any) -> Usage:
    """Token counts from an OpenAI-format ``usage`` object (also what llama.cpp's server reports)."""
    if not isinstance(doc, dict):
        return Usage()
    details = doc.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=int(doc.get("prompt_tokens") or 0),
        output_tokens=int(doc.get("completion_tokens") or 0),
        cached_input_tokens=int(details.get("cached_tokens") or 0),
    )


def _parse_call(provider: str, call_id: str, name: str, arguments: str, request: ChatRequest) -> ToolCall:
    known = {t.name for t in request.tools}
    if known and name not in known:
        raise BadToolCall(f"{provider} model called unknown tool {name!r} (offered: {sorted(known)})", provider=provider)
    try:
        args = json.loads(arguments)
    except ValueError:
        raise BadToolCall(
            f"{provider} model sent arguments for {name!r} that are not JSON: {arguments[:200]!r}",
            provider=provider,
            hint="retry the call, or raise max_tokens if the arguments were cut off",
        ) from None
    if not isinstance(args, dict):
        raise BadToolCall(f"{provider} model sent arguments for {name!r} that are not an object: {arguments[:200]!r}", provider=provider)
    return ToolCall(id=call_id, name=name, arguments=args)
