"""Model-backed memory helpers: a summarizer for compaction and a fact extractor, both through the LLM gateway.

They implement the same protocols as the offline ``ExtractiveSummarizer`` and ``PatternExtractor``, are charged
to the tenant's token budget by the gateway, and are called from worker threads (the memory tiers are sync).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Mapping, Sequence, Union

from moorage.errors import InvalidInput
from moorage.llm.gateway import LLMGateway
from moorage.llm.types import ChatRequest, Message, ResponseFormat
from moorage.log import get_logger
from moorage.memory.extraction import FactCandidate, PatternExtractor
from moorage.memory.tokens import TokenCounter

log = get_logger(__name__)

#: The event loop that runs the gateway, or a function returning it (for owners that learn it later).
LoopSource = Union[asyncio.AbstractEventLoop, Callable[[], "asyncio.AbstractEventLoop | None"]]

#: How long a memory helper waits for the model before giving up (the caller falls back or fails the write).
CALL_TIMEOUT_S = 120.0
MAX_FACTS_PER_TEXT = 8

_FACTS_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "facts": {
            "type": "array",
            "maxItems": MAX_FACTS_PER_TEXT,
            "items": {
                "type": "object",
                "properties": {
                    "subject": {"type": "string"},
                    "attribute": {"type": "string"},
                    "value": {"type": "string"},
                },
                "required": ["subject", "attribute", "value"],
            },
        }
    },
    "required": ["facts"],
}


class _GatewayCall:
    """Runs one gateway call for ``tenant_id`` on the event loop that owns the gateway, from a worker thread."""

    def __init__(self, gateway: LLMGateway, tenant_id: str, loop: LoopSource, entity: Mapping[str, str] | None) -> None:
        self.gateway = gateway
        self.tenant_id = tenant_id
        self._loop = loop
        self.entity = dict(entity or {})

    def complete(self, request: ChatRequest) -> str:
        loop = self._loop() if callable(self._loop) else self._loop
        if loop is None:
            raise InvalidInput("no event loop runs the LLM gateway yet", hint="call from inside a running moorage host")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            # Blocking here would wait on ourselves; the memory tiers must be driven from a worker thread.
            raise InvalidInput("model-backed memory helpers must be called off the event loop (asyncio.to_thread)")
        fut = asyncio.run_coroutine_threadsafe(
            self.gateway.complete(self.tenant_id, request, entity=self.entity), loop)
        return fut.result(timeout=CALL_TIMEOUT_S).text


class GatewaySummarizer:
    """Summarizes compacted turns with the tenant's model. The summary is frozen once written, so its wording
    need not be deterministic for the prompt prefix to stay byte-identical afterwards."""

    def __init__(self, gateway: LLMGateway, tenant_id: str, loop: LoopSource, *,
                 entity: Mapping[str, str] | None = None) -> None:
        self._call = _GatewayCall(gateway, tenant_id, loop, entity)

    def summarize(self, turns: Sequence[tuple[str, str]], *, max_tokens: int, counter: TokenCounter) -> str:
        transcript = "\n".join(f"{role}: {content}" for role, content in turns)
        request = ChatRequest(
            [Message.system("Summarize the conversation below for your own later reference. Keep names, numbers, "
                            "dates, decisions and what the user asked for; drop small talk. Plain text, no preamble."),
             Message.user(transcript)],
            max_tokens=max(16, max_tokens), temperature=0.0,
        )
        text = self._call.complete(request).strip()
        # The context builder cuts anything over budget; keep it from having to.
        while text and counter.count(text) > max_tokens:
            text = text[: int(len(text) * 0.9)].rstrip()
        return text


class GatewayFactExtractor:
    """Extracts (subject, attribute, value) facts from a text with the tenant's model, constrained to JSON.

    Values the text does not contain verbatim are marked ``inferred``: the write policy gives them the trust of
    a model inference, never that of something the user stated.
    """

    def __init__(self, gateway: LLMGateway, tenant_id: str, loop: LoopSource, *,
                 entity: Mapping[str, str] | None = None) -> None:
        self._call = _GatewayCall(gateway, tenant_id, loop, entity)
        #: What extracts when the model cannot: a turn never fails, or loses its message, for want of a model.
        self.fallback = PatternExtractor()

    def extract(self, text: str, *, speaker: str | None = None) -> list[FactCandidate]:
        if not text.strip():
            return []
        request = ChatRequest(
            [Message.system("List the lasting facts the speaker states about themselves or the world (names, "
                            "preferences, places, dates, relations). Use subject \"user\" for the speaker. Questions "
                            "and requests are not facts. Answer as JSON."),
             Message.user(text)],
            response_format=ResponseFormat(_FACTS_SCHEMA, "facts"), max_tokens=256, temperature=0.0,
        )
        try:
            raw = self._call.complete(request)
        except Exception as e:  # noqa: BLE001 - the provider down, a timeout, a limit: the patterns extract instead
            log.warning("fact extractor's model call failed; facts extracted by patterns instead",
                        error=type(e).__name__, detail=str(e)[:200])
            return self.fallback.extract(text, speaker=speaker)
        try:
            items = json.loads(raw).get("facts", [])
        except (ValueError, AttributeError):
            log.warning("fact extractor got no JSON from the model; facts extracted by patterns instead", chars=len(raw))
            return self.fallback.extract(text, speaker=speaker)
        out: list[FactCandidate] = []
        lowered = text.lower()
        for it in items[:MAX_FACTS_PER_TEXT]:
            if not isinstance(it, dict):
                continue
            subject, attribute, value = (str(it.get(k, "")).strip() for k in ("subject", "attribute", "value"))
            if not (subject and attribute and value) or len(value) > 200:
                continue
            attr = "_".join(attribute.lower().split())[:60]
            who = "user" if subject.lower() in ("user", "i", "me", "the user") else subject
            out.append(FactCandidate(who, attr, value, text, inferred=value.lower() not in lowered))
        return out
