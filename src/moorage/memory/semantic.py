"""Semantic memory: facts with bi-temporal validity, provenance, trust, and supersession instead of overwrite.

Owns the write policy: only what the user said becomes trusted on its own; tool and agent text waits for confirmation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.log import get_logger
from moorage.memory.errors import FactNotFound, FactNotPending
from moorage.memory.extraction import MULTI_VALUED, FactCandidate, FactExtractor, PatternExtractor, normalize_value
from moorage.store import Event, Fact, Scope, TenantStore
from moorage.webhooks.facts import announce_pending

log = get_logger(__name__)

Origin = Literal["user", "tool", "agent", "model"]
ORIGINS: tuple[str, ...] = ("user", "tool", "agent", "model")
#: Higher wins. A lower-trust value never silently replaces a higher-trust one.
TRUST_RANK = {"user_stated": 3, "tool_derived": 2, "model_inferred": 1}
Action = Literal["inserted", "merged", "superseded", "pending", "confirmed", "rejected"]


@dataclass(frozen=True)
class TurnRef:
    """The turn a fact was learned in (its run and trace), carried into the ``fact.pending`` webhook event."""

    run_id: str
    trace_id: str | None = None


@dataclass(frozen=True)
class FactChange:
    """What one write did: the fact as stored now, and the fact it closed, if any."""

    action: Action
    fact: Fact
    previous: Fact | None = None


def origin_of(event: Event) -> Origin:
    """Where an event's text came from, judged from what the host recorded (never from the text itself)."""
    speaker = (event.speaker or "").lower()
    kind = event.kind.lower()
    if kind.startswith("tool") or speaker == "tool" or speaker.startswith("tool:"):
        return "tool"
    if speaker == "user":
        return "user"
    if speaker in ("assistant", "model"):
        return "model"
    return "agent"


def trust_for(origin: Origin, inferred: bool) -> str:
    if origin == "tool":
        return "tool_derived"
    if origin == "user" and not inferred:
        return "user_stated"
    return "model_inferred"


class SemanticMemory:
    """Facts of one tenant's scopes. Writes go through ``record``/``observe``; nothing is ever deleted.

    Policy:
    - a different value for the same subject+attribute supersedes the current fact (closed with
      ``valid_to`` and ``superseded_by``), unless its trust is lower: then it waits as ``pending``;
    - the same value again merges: provenance is extended on the existing row, no new row;
    - text that did not come from the user (tool output, another agent, the model) lands ``pending``
      and is left out of trusted recall until ``confirm``; so an instruction injected into a tool
      result cannot turn itself into a standing fact.

    A new pending fact queues the ``fact.pending`` webhook event in the same transaction (``webhooks.facts``).
    """

    def __init__(
        self, ts: TenantStore, extractor: FactExtractor | None = None, *, clock: Callable[[], float] = time.time,
    ) -> None:
        self.ts = ts
        self.extractor: FactExtractor = extractor or PatternExtractor()
        self.clock = clock

    # -- writing -------------------------------------------------------------------------------

    def observe(self, scope: Scope, event: Event, *, turn: TurnRef | None = None) -> list[FactChange]:
        """Extract facts from one logged event and record them with the event as provenance."""
        origin = origin_of(event)
        changes = []
        for cand in self.extractor.extract(event.content, speaker=event.speaker):
            changes.append(self.record(scope, cand, origin=origin, evidence=[str(event.id)], valid_from=event.ts,
                                       turn=turn))
        return changes

    def record(
        self, scope: Scope, candidate: FactCandidate, *, origin: Origin, evidence: Sequence[str] = (),
        valid_from: float | None = None, turn: TurnRef | None = None,
    ) -> FactChange:
        """Apply the write policy to one candidate fact; retried once if another writer raced us. ``turn``: the
        turn it was learned in, named by the ``fact.pending`` event if it waits for confirmation."""
        if origin not in ORIGINS:
            raise InvalidInput(f"unknown fact origin {origin!r}", hint=f"one of {', '.join(ORIGINS)}")
        for name in ("subject", "attribute", "value"):
            if not str(getattr(candidate, name)).strip():
                # A fact nobody can look up (or one that says nothing) is refused before anything is written.
                raise InvalidInput(f"a fact's {name} must not be empty", hint="pass the subject, attribute and value")
        # Inside a caller's transaction a retry would run next to the failed attempt's writes: the caller retries.
        joined = self.ts.ambient() is not None
        for attempt in (1, 2):
            try:
                with self.ts.transaction():
                    change = self._record(scope, candidate, origin, [str(e) for e in evidence], valid_from)
                    if change.action == "pending":
                        # In the write's transaction: the event is queued if and only if the fact is recorded.
                        announce_pending(self.ts, change.fact, run_id=turn.run_id if turn else None,
                                         trace_id=turn.trace_id if turn else None)
                    return change
            except ConflictError:
                if attempt == 2 or joined:
                    raise
                log.info("fact write raced, retrying", scope=scope.key, attribute=candidate.attribute)
        raise AssertionError("unreachable")

    def _record(self, scope: Scope, c: FactCandidate, origin: Origin, evidence: list[str], valid_from: float | None) -> FactChange:
        trust = trust_for(origin, c.inferred)
        when = self.clock() if valid_from is None else valid_from
        key = normalize_value(c.value)
        facts = self.ts.facts
        facts.lock(scope)  # concurrent writers of this scope take turns: each reads what the one before wrote
        # Only the rows this write can touch are read: those with the same value (by its comparable form), then
        # the attribute's current value. Pending rows pile up (an agent that records a new value every turn) and
        # closed ones never go, so reading all of them made every write cost the user's whole history.
        same = next(iter(facts.current_matching(scope, c.subject, c.attribute, status="active", key=key,
                                                keyer=normalize_value)), None)
        if same is not None:
            return FactChange("merged", self._merge(same, evidence, trust if origin == "user" else None))
        if origin != "user":
            waiting = next(iter(facts.current_matching(scope, c.subject, c.attribute, status="pending", key=key,
                                                       keyer=normalize_value)), None)
            if waiting is not None:
                return FactChange("merged", self._merge(waiting, evidence, None))
            f = facts.insert(scope, c.subject, c.attribute, c.value, c.text, valid_from=when, trust=trust,
                             status="pending", provenance=evidence, source=origin, value_key=key)
            return FactChange("pending", f)

        active = [] if c.attribute in MULTI_VALUED else facts.current(scope, c.subject, c.attribute)
        if not active:
            f = facts.insert(scope, c.subject, c.attribute, c.value, c.text, valid_from=when, trust=trust,
                             status="active", provenance=evidence, source=origin, value_key=key)
            return FactChange("inserted", f)

        current = max(active, key=lambda f: (f.valid_from, f.recorded_at))
        if TRUST_RANK[trust] < TRUST_RANK[current.trust]:
            f = facts.insert(scope, c.subject, c.attribute, c.value, c.text, valid_from=when, trust=trust,
                             status="pending", provenance=evidence, source=origin, value_key=key)
            return FactChange("pending", f)
        return self._supersede(scope, current, c.subject, c.attribute, c.value, c.text, when, trust, evidence, origin)

    def _supersede(self, scope: Scope, current: Fact, subject: str, attribute: str, value: str, text: str,
                   when: float, trust: str, evidence: list[str], source: str) -> FactChange:
        # A statement dated before the current fact began still only ends it from its own start.
        when = max(when, current.valid_from)
        new = self.ts.facts.insert(scope, subject, attribute, value, text, valid_from=when, trust=trust,
                                   status="active", provenance=evidence, source=source, value_key=normalize_value(value))
        # Believed until the new value was recorded, not a moment later: "known at" never sees both.
        closed = self.ts.facts.close(current.id, expected_version=current.version, valid_to=when, superseded_by=new.id,
                                     superseded_at=new.recorded_at)
        return FactChange("superseded", new, closed)

    def _merge(self, fact: Fact, evidence: list[str], trust: str | None) -> Fact:
        prov = list(fact.provenance) + [e for e in evidence if e not in fact.provenance]
        raise_trust = trust is not None and TRUST_RANK[trust] > TRUST_RANK[fact.trust]
        if prov == list(fact.provenance) and not raise_trust:
            return fact
        return self.ts.facts.update(fact.id, expected_version=fact.version, provenance=prov,
                                    trust=trust if raise_trust else None)

    def confirm(self, scope: Scope, fact_id: str, *, evidence: Sequence[str] = ()) -> FactChange:
        """A person vouched for a pending fact: it becomes active and supersedes the current value. It is believed
        from now (``confirmed_at``): ``known_at`` before this instant still answers the value it replaces."""
        with self.ts.transaction():
            self.ts.facts.lock(scope)
            f = self._get(scope, fact_id)
            if f.status != "pending":
                raise FactNotPending(f"fact {fact_id} is {f.status}, not pending",
                                     hint="only a pending fact can be confirmed; list them with GET …/facts/pending")
            prov = list(f.provenance) + [str(e) for e in evidence if str(e) not in f.provenance]
            active = [a for a in self.ts.facts.list(scope, subject=f.subject, attribute=f.attribute) if a.id != f.id]
            same = next((a for a in active if normalize_value(a.value) == normalize_value(f.value)), None)
            if same is not None:  # already believed: fold the pending row into it
                merged = self._merge(same, prov, None)
                self.ts.facts.update(f.id, expected_version=f.version, status="rejected", superseded_by=same.id,
                                     valid_to=f.valid_from)
                return FactChange("merged", merged)
            now = time.time()  # the store's recording clock (``recorded_at``), not ``self.clock`` (valid time)
            confirmed = self.ts.facts.update(f.id, expected_version=f.version, status="active", provenance=prov,
                                             confirmed_at=now)
            previous = None
            if f.attribute not in MULTI_VALUED and active:
                current = max(active, key=lambda a: (a.valid_from, a.recorded_at))
                # No longer believed from the instant the confirmed value is: ``known_at`` never sees both.
                previous = self.ts.facts.close(current.id, expected_version=current.version,
                                               valid_to=max(f.valid_from, current.valid_from), superseded_by=f.id,
                                               superseded_at=now)
            return FactChange("confirmed", confirmed, previous)

    def reject(self, scope: Scope, fact_id: str) -> FactChange:
        """Discard a pending fact; it stays on record as ``rejected`` for the audit trail."""
        f = self._get(scope, fact_id)
        if f.status != "pending":
            raise FactNotPending(f"fact {fact_id} is {f.status}, not pending",
                                 hint="only a pending fact can be rejected; list them with GET …/facts/pending")
        return FactChange("rejected", self.ts.facts.update(f.id, expected_version=f.version, status="rejected"))

    # -- reading -------------------------------------------------------------------------------

    def recall(
        self, scope: Scope, *, subject: str | None = None, attribute: str | None = None,
        valid_at: float | None = None, known_at: float | None = None, include_pending: bool = False,
    ) -> list[Fact]:
        """Trusted facts (``active``) true now, or true at ``valid_at``, or as believed at ``known_at``."""
        statuses = ("active", "pending") if include_pending else ("active",)
        return self.ts.facts.list(scope, subject=subject, attribute=attribute, valid_at=valid_at,
                                  known_at=known_at, statuses=statuses)

    def current(self, scope: Scope, subject: str, attribute: str, *, at: float | None = None) -> Fact | None:
        """The trusted value of one attribute now (or at ``at``), or ``None``."""
        facts = self.recall(scope, subject=subject, attribute=attribute, valid_at=at)
        return max(facts, key=lambda f: (f.valid_from, f.recorded_at)) if facts else None

    def history(self, scope: Scope, subject: str, attribute: str) -> list[Fact]:
        """Every trusted value the attribute has had, oldest first, closed ones included."""
        return self.ts.facts.list(scope, subject=subject, attribute=attribute, include_closed=True, limit=None)

    def pending(self, scope: Scope) -> list[Fact]:
        """Every pending fact of the scope (``Facts.waiting`` reads them a page at a time), oldest first."""
        return self.ts.facts.list(scope, statuses=("pending",), include_closed=True, limit=None)

    def _get(self, scope: Scope, fact_id: str) -> Fact:
        try:
            f = self.ts.facts.get(fact_id)
        except NotFound as e:
            raise FactNotFound(f"no fact {fact_id!r} in this tenant", hint="list the user's pending facts with `moorage memory pending AGENT USER` "
                               "(GET /v1/agents/{agent}/users/{user}/facts/pending)") from e
        if f.scope != scope:
            raise FactNotFound(f"no fact {fact_id!r} in scope {scope.key}")
        return f
