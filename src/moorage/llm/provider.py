"""The one interface every model provider implements, and what each says it can do.

Adapters: ``OpenAICompatibleProvider``, ``AnthropicProvider``, ``EmbeddedProvider``; one conformance suite
(tests/llm/test_conformance.py) proves them equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from moorage.llm.types import ChatChunk, ChatRequest, ChatResponse, Message, ToolSpec


@dataclass(frozen=True)
class Capabilities:
    streaming: bool = True
    tools: bool = True
    json_schema: bool = True
    #: True when ``count_tokens`` uses the model's own tokenizer; False when it is an estimate.
    exact_token_count: bool = False
    #: True when the provider reports prompt-cache hits in ``Usage.cached_input_tokens``.
    reports_cached_tokens: bool = True


@runtime_checkable
class Provider(Protocol):
    #: Short stable name used in routing, accounting and logs ("openai", "anthropic", "embedded").
    name: str
    #: Model used when a request leaves ``model`` empty.
    default_model: str
    capabilities: Capabilities

    async def complete(self, request: ChatRequest) -> ChatResponse:
        """Run one model call to the end."""
        ...

    def stream(self, request: ChatRequest) -> AsyncIterator[ChatChunk]:
        """Run one model call, yielding the answer as it is produced."""
        ...

    async def count_tokens(self, messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
        """Input tokens these messages (or this text) would cost; see ``capabilities.exact_token_count``."""
        ...

    async def aclose(self) -> None:
        """Release connections; the provider is not used afterwards."""
        ...


async def collect(chunks: AsyncIterator[ChatChunk], *, provider: str = "", latency_ms: float = 0.0) -> ChatResponse:
    """Fold a stream into the ``ChatResponse`` the same call would have returned."""
    from moorage.llm.types import Usage

    text: list[str] = []
    calls = []
    finish = None
    usage = Usage()
    model = ""
    async for c in chunks:
        text.append(c.text)
        calls.extend(c.tool_calls)
        finish = c.finish_reason or finish
        usage = c.usage or usage
        model = c.model or model
    return ChatResponse(
        text="".join(text),
        tool_calls=tuple(calls),
        finish_reason=finish or "stop",
        usage=usage,
        model=model,
        provider=provider,
        latency_ms=latency_ms,
    )


def whole_as_chunks(response: ChatResponse) -> tuple[ChatChunk, ...]:
    """A complete answer as the chunks a stream of it ends with (``collect`` of them gives it back)."""
    text = (ChatChunk(text=response.text, model=response.model),) if response.text else ()
    return text + (ChatChunk(tool_calls=response.tool_calls, finish_reason=response.finish_reason,
                             usage=response.usage, model=response.model),)
