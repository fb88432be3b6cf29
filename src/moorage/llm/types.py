"""The provider-neutral shapes of a model call: messages, tools, requests, responses, chunks, usage.

Every provider adapter translates these to and from its wire format; nothing above ``llm/`` sees a wire format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from moorage.errors import InvalidInput

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "error"]
#: ``auto``: the model decides; ``none``: never call a tool; ``required``: must call one; any other
#: string is the name of the one tool the model must call.
ToolChoice = str


@dataclass(frozen=True)
class ToolCall:
    """The model asking the caller to run a tool. ``arguments`` is already parsed JSON."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    #: Set on assistant messages that asked for tools.
    tool_calls: tuple[ToolCall, ...] = ()
    #: Set on ``tool`` messages: which call this is the result of.
    tool_call_id: str | None = None
    #: Set on ``tool`` messages: the tool's name (some wire formats and the embedded model need it).
    name: str | None = None

    @staticmethod
    def system(text: str) -> "Message":
        return Message("system", text)

    @staticmethod
    def user(text: str) -> "Message":
        return Message("user", text)

    @staticmethod
    def assistant(text: str = "", tool_calls: Sequence[ToolCall] = ()) -> "Message":
        return Message("assistant", text, tool_calls=tuple(tool_calls))

    @staticmethod
    def tool_result(call: ToolCall, result: Any) -> "Message":
        """The result of running ``call``; non-string results are sent as JSON."""
        text = result if isinstance(result, str) else json.dumps(result)
        return Message("tool", text, tool_call_id=call.id, name=call.name)


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; ``parameters`` is a JSON schema of an object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ResponseFormat:
    """Ask for JSON output matching ``schema`` (the response's ``text`` is that JSON)."""

    schema: Mapping[str, Any]
    name: str = "response"


@dataclass(frozen=True)
class ChatRequest:
    messages: Sequence[Message]
    #: Empty means "the provider's configured model".
    model: str = ""
    tools: Sequence[ToolSpec] = ()
    tool_choice: ToolChoice = "auto"
    response_format: ResponseFormat | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    stop: Sequence[str] = ()
    #: Whose prompt cache the call may use. The gateway sets it to the tenant id (a caller cannot choose
    #: it); a provider that keeps a prompt cache in this process never reuses it across scopes.
    cache_scope: str = ""

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidInput("a chat request needs at least one message")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tool names must be unique, got {names}")
        if self.tool_choice not in ("auto", "none", "required") and self.tool_choice not in names:
            raise InvalidInput(
                f"tool_choice {self.tool_choice!r} names no tool in this request",
                hint="use 'auto', 'none', 'required' or the name of one of the request's tools",
            )
        if self.tool_choice == "required" and not self.tools:
            raise InvalidInput("tool_choice 'required' needs at least one tool")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Usage:
    """Token counts as reported by the provider.

    ``input_tokens`` counts every prompt token, cached or not; ``cached_input_tokens`` is the
    part of it served from the provider's prompt cache (billed cheaper by most providers).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class ChatResponse:
    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    usage: Usage
    model: str
    provider: str
    latency_ms: float

    def json(self) -> Any:
        """The text parsed as JSON (for requests with a ``response_format``)."""
        return json.loads(self.text)

    def as_message(self) -> Message:
        """This answer as the assistant message to append to the conversation."""
        return Message.assistant(self.text, self.tool_calls)


@dataclass(frozen=True)
class ChatChunk:
    """One piece of a streamed answer.

    Text arrives as deltas; a tool call arrives whole once its arguments are complete (partial
    JSON is of no use to a caller). The last chunk has ``finish_reason`` and ``usage`` set.
    """

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    model: str = ""
