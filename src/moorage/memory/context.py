"""Working memory: builds each model call's input as a stable prefix plus an append-only tail.

Compaction appends frozen summary segments and never rewrites what an earlier call sent, so provider prefix caches keep hitting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from moorage.errors import InvalidInput
from moorage.log import get_logger
from moorage.memory.errors import ContextBudgetError
from moorage.memory.summarize import ExtractiveSummarizer, Summarizer
from moorage.memory.tokens import MiniLMTokenCounter, TokenCounter

log = get_logger(__name__)

ROLES = ("user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One chat message. ``render()`` is its canonical byte form: equal messages give equal bytes."""

    role: str
    content: str
    name: str | None = None

    def to_dict(self) -> dict[str, str]:
        d = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        return d

    def render(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class CompactionPolicy:
    """When and how far the tail is compacted. All sizes are input tokens as the counter counts them.

    The share of a call that can hit a prefix cache is bounded by where the first change sits: compaction
    drops the oldest tail turns, so everything after the frozen prefix is re-sent. Keeping the verbatim tail
    short relative to the prefix (``compact_at_tokens``, ``keep_recent_tokens``) is what keeps that share high.
    """

    #: Hard cap on one call's input; never exceeded.
    budget_tokens: int = 8192
    #: Compact once the verbatim tail is larger than this.
    compact_at_tokens: int = 768
    #: Verbatim tokens kept after a compaction (the newest turns; at least the newest one).
    keep_recent_tokens: int = 128
    #: Upper bound on one frozen summary segment.
    summary_max_tokens: int = 96
    #: A compaction is postponed while the turns new to this call exceed this many tokens (a bulky tool
    #: result is already a cache miss; stacking the compaction's miss on it would double the cost). The
    #: postponement ends when the tail passes twice ``compact_at_tokens`` or the budget would be exceeded.
    defer_when_new_over_tokens: int = 120
    #: When the frozen summaries together pass this, they are merged into one (a rare, logged cache break).
    #: ``None``: half of what the system prompt and tool schemas leave of the budget.
    summaries_max_tokens: int | None = None
    #: A single turn larger than this is cut (head kept) when added; it could never fit otherwise.
    max_turn_tokens: int = 2048

    def validate(self) -> None:
        if not 0 < self.keep_recent_tokens < self.compact_at_tokens < self.budget_tokens:
            raise InvalidInput(
                "compaction policy needs 0 < keep_recent_tokens < compact_at_tokens < budget_tokens",
                hint=f"got keep_recent={self.keep_recent_tokens} compact_at={self.compact_at_tokens} budget={self.budget_tokens}",
            )
        if self.summary_max_tokens <= 0 or (self.summaries_max_tokens is not None and self.summaries_max_tokens < self.summary_max_tokens):
            raise InvalidInput("compaction policy needs 0 < summary_max_tokens <= summaries_max_tokens")


@dataclass
class _Turn:
    index: int
    message: Message
    tokens: int


@dataclass
class _Segment:
    first: int
    last: int
    message: Message
    tokens: int


@dataclass(frozen=True)
class ModelInput:
    """What to send for one model call, with the figures that explain its cost."""

    messages: list[dict[str, str]]
    input_tokens: int
    #: Tokens of the frozen prefix (system prompt, tools, summaries) at the front of ``messages``.
    prefix_tokens: int
    #: Tokens at the front that are byte-identical to the front of the previous call's input.
    reused_tokens: int
    compacted: bool = False
    consolidated: bool = False

    @property
    def reused_share(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass
class ContextStats:
    calls: int = 0
    compactions: int = 0
    consolidations: int = 0
    truncated_turns: int = 0
    input_tokens: int = 0
    reused_tokens: int = 0
    shares: list[float] = field(default_factory=list)


class ContextBuilder:
    """Keeps one session's working memory and renders it for each model call.

    Layout of every call: ``[system prompt + tool schemas] [summary 1] … [summary k] [turn … turn]``.
    Everything before the tail is frozen: built once and rendered to the same bytes on every call.
    """

    def __init__(
        self,
        system_prompt: str,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        policy: CompactionPolicy | None = None,
        counter: TokenCounter | None = None,
        summarizer: Summarizer | None = None,
    ) -> None:
        self.policy = policy or CompactionPolicy()
        self.policy.validate()
        self.counter: TokenCounter = counter or MiniLMTokenCounter()
        self.summarizer: Summarizer = summarizer or ExtractiveSummarizer()
        self._system = Message("system", _system_text(system_prompt, tools))
        self._system_tokens = self._tokens(self._system)
        self._segments: list[_Segment] = []
        self._tail: list[_Turn] = []
        self._next_index = 1
        self._previous: list[bytes] = []
        self._sent: set[int] = set()
        self.stats = ContextStats()
        # Worst case after a consolidation: system + one summary + the newest turn. The newest turn is cut
        # to what that leaves, which is what makes the budget a hard one.
        room = self.policy.budget_tokens - self._system_tokens - self.policy.summary_max_tokens
        self._max_turn_tokens = min(self.policy.max_turn_tokens, room)
        free = self.policy.budget_tokens - self._system_tokens
        self._summaries_max = self.policy.summaries_max_tokens or max(self.policy.summary_max_tokens, free // 2)
        if room < max(64, self.policy.keep_recent_tokens):
            raise ContextBudgetError(
                f"system prompt and tool schemas take {self._system_tokens} tokens of the "
                f"{self.policy.budget_tokens}-token budget, leaving {room} for the conversation",
                hint="raise budget_tokens, or shorten the system prompt or tool schemas",
            )

    # -- input ---------------------------------------------------------------------------------

    def add(self, role: str, content: str, *, name: str | None = None) -> int:
        """Append one turn (user, assistant or tool output); returns its turn index."""
        if role not in ROLES:
            raise InvalidInput(f"unknown role {role!r}", hint=f"use one of {', '.join(ROLES)}")
        msg = Message(role, content, name)
        tokens = self._tokens(msg)
        if tokens > self._max_turn_tokens:
            msg = Message(role, self._cut(content, self._max_turn_tokens - self.counter.per_message_overhead), name)
            tokens = self._tokens(msg)
            self.stats.truncated_turns += 1
        turn = _Turn(self._next_index, msg, tokens)
        self._next_index += 1
        self._tail.append(turn)
        return turn.index

    # -- output --------------------------------------------------------------------------------

    def build(self) -> ModelInput:
        """The input of the next model call; compacts first when the policy says so."""
        compacted = consolidated = False
        if self._should_compact():
            compacted = self._compact()
        if self._summary_tokens() > self._summaries_max or self._total() > self.policy.budget_tokens:
            consolidated = self._consolidate()
        total = self._total()
        if total > self.policy.budget_tokens:  # only reachable with a counter that disagrees with itself
            raise ContextBudgetError(f"context needs {total} tokens, over the budget of {self.policy.budget_tokens}")

        msgs = self._messages()
        rendered = [m.render() for m in msgs]
        token_list = [self._system_tokens] + [s.tokens for s in self._segments] + [t.tokens for t in self._tail]
        reused = 0
        for i, blob in enumerate(rendered):
            if i >= len(self._previous) or self._previous[i] != blob:
                break
            reused += token_list[i]
        self._previous = rendered
        self._sent = {t.index for t in self._tail}
        out = ModelInput(
            messages=[m.to_dict() for m in msgs],
            input_tokens=total,
            prefix_tokens=self._system_tokens + self._summary_tokens(),
            reused_tokens=reused,
            compacted=compacted,
            consolidated=consolidated,
        )
        self.stats.calls += 1
        self.stats.input_tokens += total
        self.stats.reused_tokens += reused
        self.stats.shares.append(out.reused_share)
        return out

    def frozen_prefix(self) -> bytes:
        """The frozen part of the input as one byte string (identical across calls until the next compaction)."""
        return b"\n".join(m.render() for m in [self._system] + [s.message for s in self._segments])

    # -- persistence ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-able state, so a woken agent rebuilds exactly the same bytes it sent before sleeping."""
        return {
            "next_index": self._next_index,
            "segments": [{"first": s.first, "last": s.last, **s.message.to_dict()} for s in self._segments],
            "tail": [{"index": t.index, **t.message.to_dict()} for t in self._tail],
            "previous": [b.decode("utf-8") for b in self._previous],
            "sent": sorted(self._sent),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self._next_index = int(state["next_index"])
        self._segments = []
        for s in state["segments"]:
            m = Message(s["role"], s["content"], s.get("name"))
            self._segments.append(_Segment(int(s["first"]), int(s["last"]), m, self._tokens(m)))
        self._tail = []
        for t in state["tail"]:
            m = Message(t["role"], t["content"], t.get("name"))
            self._tail.append(_Turn(int(t["index"]), m, self._tokens(m)))
        self._previous = [p.encode("utf-8") for p in state.get("previous", [])]
        self._sent = {int(i) for i in state.get("sent", [])}

    # -- internals -----------------------------------------------------------------------------

    def _tokens(self, m: Message) -> int:
        return self.counter.count(m.content) + self.counter.per_message_overhead

    def _tail_tokens(self) -> int:
        return sum(t.tokens for t in self._tail)

    def _summary_tokens(self) -> int:
        return sum(s.tokens for s in self._segments)

    def _total(self) -> int:
        return self._system_tokens + self._summary_tokens() + self._tail_tokens()

    def _messages(self) -> list[Message]:
        return [self._system] + [s.message for s in self._segments] + [t.message for t in self._tail]

    def _should_compact(self) -> bool:
        tail = self._tail_tokens()
        if self._total() > self.policy.budget_tokens or tail > 2 * self.policy.compact_at_tokens:
            return True
        if tail <= self.policy.compact_at_tokens:
            return False
        new = sum(t.tokens for t in self._tail if t.index not in self._sent)
        return new <= self.policy.defer_when_new_over_tokens

    def _compact(self) -> bool:
        """Move the oldest tail turns into a new frozen summary, keeping ``keep_recent_tokens`` verbatim."""
        if len(self._tail) < 2:
            return False
        split = len(self._tail) - 1  # the newest turn is always kept verbatim
        kept = self._tail[-1].tokens
        while split > 0 and kept + self._tail[split - 1].tokens <= self.policy.keep_recent_tokens:
            split -= 1
            kept += self._tail[split].tokens
        # A tool result must not open the tail without the call that produced it.
        while split < len(self._tail) - 1 and self._tail[split].message.role == "tool":
            split += 1
        # Even the kept turns must fit next to the prefix: shrink the verbatim tail under budget pressure.
        room = self.policy.budget_tokens - self._system_tokens - self._summary_tokens() - self.policy.summary_max_tokens
        while split < len(self._tail) - 1 and sum(t.tokens for t in self._tail[split:]) > room:
            split += 1
        covered, self._tail = self._tail[:split], self._tail[split:]
        if not covered:
            return False
        self._segments.append(self._summarize(covered[0].index, covered[-1].index, [(t.message.role, t.message.content) for t in covered]))
        self.stats.compactions += 1
        return True

    def _consolidate(self) -> bool:
        """Merge all frozen summaries into one. Rewrites the prefix, so it is kept rare and logged."""
        if len(self._segments) < 2:
            return False
        first, last = self._segments[0].first, self._segments[-1].last
        turns = [("summary", _strip_header(s.message.content)) for s in self._segments]
        self._segments = [self._summarize(first, last, turns)]
        self.stats.consolidations += 1
        log.info("context summaries consolidated", first_turn=first, last_turn=last, tokens=self._segments[0].tokens)
        return True

    def _summarize(self, first: int, last: int, turns: list[tuple[str, str]]) -> _Segment:
        header = f"[Summary of earlier conversation, turns {first}-{last}]"
        budget = self.policy.summary_max_tokens - self.counter.per_message_overhead - self.counter.count(header) - 1
        body = self.summarizer.summarize(turns, max_tokens=max(budget, 1), counter=self.counter)
        text = f"{header}\n{body}" if body else header
        msg = Message("system", text)
        tokens = self._tokens(msg)
        if tokens > self.policy.summary_max_tokens:  # a summarizer that overshot: cut, never exceed
            msg = Message("system", self._cut(text, self.policy.summary_max_tokens - self.counter.per_message_overhead))
            tokens = self._tokens(msg)
        return _Segment(first, last, msg, tokens)

    def _cut(self, text: str, max_tokens: int) -> str:
        marker = " […cut]"
        limit = max_tokens - self.counter.count(marker)
        lo, hi = 0, len(text)
        while lo < hi:  # longest prefix (in characters) that fits, by bisection
            mid = (lo + hi + 1) // 2
            if self.counter.count(text[:mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo] + marker


def _system_text(system_prompt: str, tools: Sequence[Mapping[str, Any]]) -> str:
    if not isinstance(system_prompt, str):
        raise InvalidInput(f"the system prompt must be a string, got {type(system_prompt).__name__}")
    if isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
        # A string would be rendered one character per "schema".
        raise InvalidInput("tools must be a list of tool schemas (JSON objects)",
                           hint='e.g. [{"name": "get_weather", "parameters": {...}}]')
    if not tools:
        return system_prompt
    # Canonical JSON: the same schemas always give the same bytes, whatever dict order the caller used.
    schemas = json.dumps(list(tools), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return f"{system_prompt}\n\n# Tools\n{schemas}"


def _strip_header(text: str) -> str:
    return text.split("\n", 1)[1] if text.startswith("[Summary") and "\n" in text else text
