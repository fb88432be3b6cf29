"""Summarizers that turn a run of chat turns into a frozen summary segment for the context builder.

``Summarizer`` is the protocol (an LLM-backed one arrives through the gateway); ``ExtractiveSummarizer`` works offline.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Protocol, Sequence, runtime_checkable

from moorage.memory.tokens import TokenCounter

_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'_-]*")
_STOP = frozenset(
    "a an the and or but if then so to of in on at for with from by as is are was were be been being it its "
    "this that these those i you he she we they me him her us them my your our their do does did not no yes "
    "can could would should will shall may might must have has had just also very really ok okay please thanks "
    "thank sure what which who whom how when where why there here about into over than too".split()
)


@runtime_checkable
class Summarizer(Protocol):
    """Condenses ``turns`` (role, content pairs, oldest first) into at most ``max_tokens`` tokens."""

    def summarize(self, turns: Sequence[tuple[str, str]], *, max_tokens: int, counter: TokenCounter) -> str: ...


class ExtractiveSummarizer:
    """Keeps the most informative sentences verbatim, in their original order, tagged with the speaker.

    Scores favour sentences dense in words that recur in the chunk (the topic), numbers and proper
    names (the facts people ask about later), and what the user said over what the assistant said.
    Deterministic: the same turns always give the same summary, so rebuilt prefixes stay byte-identical.
    """

    def __init__(self, user_weight: float = 1.5, max_sentence_chars: int = 300) -> None:
        self.user_weight = user_weight
        self.max_sentence_chars = max_sentence_chars

    def summarize(self, turns: Sequence[tuple[str, str]], *, max_tokens: int, counter: TokenCounter) -> str:
        sentences: list[tuple[int, str, str]] = []  # (position, role, text)
        seen: set[str] = set()
        for role, content in turns:
            for m in _SENTENCE.finditer(content):
                s = " ".join(m.group(0).split())
                if len(_WORD.findall(s)) >= 3 and s.lower() not in seen:
                    seen.add(s.lower())
                    sentences.append((len(sentences), role, s[: self.max_sentence_chars]))
        if not sentences:
            return ""
        freq = Counter(w.lower() for _, _, s in sentences for w in _WORD.findall(s) if w.lower() not in _STOP)

        def score(item: tuple[int, str, str]) -> float:
            _, role, s = item
            words = _WORD.findall(s)
            content_words = [w for w in words if w.lower() not in _STOP]
            base = sum(math.log1p(freq[w.lower()]) for w in content_words)
            facts = sum(1 for w in words if w[0].isdigit() or (w[0].isupper() and w.lower() not in _STOP))
            weight = self.user_weight if role == "user" else 1.0
            return weight * (base + 1.5 * facts) / math.sqrt(len(words) + 1)

        chosen: list[tuple[int, str, str]] = []
        used = 0
        for item in sorted(sentences, key=lambda it: (-score(it), it[0])):
            line = f"{item[1]}: {item[2]}"
            cost = counter.count(line) + 1
            if used + cost > max_tokens:
                continue
            chosen.append(item)
            used += cost
        chosen.sort(key=lambda it: it[0])
        return "\n".join(f"{role}: {s}" for _, role, s in chosen)
