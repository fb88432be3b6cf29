"""Token estimates for providers whose tokenizer we do not have offline (OpenAI-compatible, Anthropic).

Used only before a call (rate limits, budget pre-checks); accounting always uses the provider's reported usage.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

from moorage.llm.types import Message, ToolSpec

#: BPE tokenizers of current chat models average about 4 bytes of English text per token;
#: non-Latin scripts use more bytes per character, so counting UTF-8 bytes keeps the estimate
#: from undercounting them badly.
BYTES_PER_TOKEN = 4.0
#: Role markers and separators each chat template adds around a message.
PER_MESSAGE_OVERHEAD = 4
#: Tokens that prime the assistant's reply.
REPLY_PRIMING = 3


def estimate_text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN) if text else 0


def estimate_tokens(messages: Sequence[Message] | str, tools: Sequence[ToolSpec] = ()) -> int:
    """An approximation of the input tokens of a chat call (documented in docs/llm.md)."""
    if isinstance(messages, str):
        return estimate_text_tokens(messages)
    total = REPLY_PRIMING
    for m in messages:
        total += PER_MESSAGE_OVERHEAD + estimate_text_tokens(m.content)
        for c in m.tool_calls:
            total += estimate_text_tokens(c.name) + estimate_text_tokens(json.dumps(c.arguments))
    for t in tools:
        total += estimate_text_tokens(t.name + t.description + json.dumps(t.parameters))
    return total
