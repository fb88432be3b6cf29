"""Trace spans of the tenant's turns and workflows: recorded (replacing a span of the same id), read
per trace or newest first."""

from __future__ import annotations

from moorage.store.model import Scope, Span
from moorage.store.repos.common import _now, _Repo
from moorage.store.sql import loads


_SPAN_COLS = "trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, scope"


def _span(r: tuple) -> Span:
    return Span(r[0], r[1], r[2], r[3], r[4], r[5], r[6], loads(r[7]), Scope.parse(r[8]) if r[8] else None)


def _about(span: Span) -> tuple[str | None, str | None]:
    """The end-user (and agent) an unscoped span names in its attributes, as its ``user_id`` and ``agent_id``
    columns hold them (migration 21): what forgetting that user finds it by. A scoped span goes with its scope."""
    if span.scope is not None:
        return None, None
    user, agent = span.attrs.get("moorage.user"), span.attrs.get("moorage.agent")
    if not isinstance(user, str):
        return None, None
    return user, agent if isinstance(agent, str) else None


#: The kinds of scope a span may have (``Scope.key``'s prefixes).
_SCOPE_KINDS = ("user", "session", "workflow")


def of_agent(agent: str) -> tuple[str, list[object]]:
    """A condition for the spans of one agent: scoped to one of its scopes (a range per kind: a scope key is
    ``kind:agent/...`` and an agent id holds no "/"; "0" is the character after it), or unscoped and naming it
    (an API request's about it, a share link's: the ``agent_id`` column of migration 21). The ranges compare
    ``scope || ''``, which no index answers: a page of an agent's recent spans walks the start-time index newest
    first and stops at the page; through the scope index (migration 26) it read every span of the agent and sorted
    them (190 ms against 7 for 1,000 of 45,000 spans, bench/results/latest/scale.md)."""
    ranges = " OR ".join("((scope || '') >= ? AND (scope || '') < ?)" for _ in _SCOPE_KINDS)
    params: list[object] = [p for kind in _SCOPE_KINDS for p in (f"{kind}:{agent}/", f"{kind}:{agent}0")]
    return f"({ranges} OR (scope IS NULL AND agent_id = ?))", [*params, agent]


class Spans(_Repo):
    def record(self, span: Span) -> None:
        with self._ts._tx() as c:
            c.x("DELETE FROM spans WHERE span_id = ?", (span.span_id,))
            c.x(
                f"INSERT INTO spans ({_SPAN_COLS}, user_id, agent_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (span.trace_id, span.span_id, span.parent_id, span.name, span.start_ts, span.end_ts, span.status,
                 self._json(span.attrs, "span attributes"), span.scope.key if span.scope else None, *_about(span)),
            )
            if span.scope is not None:
                self._ts._touch(c, span.scope, _now())

    def trace(self, trace_id: str, *, agent: str | None = None) -> list[Span]:
        """Every span of one trace in start order; ``agent``: only that agent's (``of_agent``)."""
        cond, more = of_agent(agent) if agent is not None else ("1 = 1", [])
        with self._ts._tx(write=False) as c:
            return [_span(r) for r in c.q(f"SELECT {_SPAN_COLS} FROM spans WHERE trace_id = ? AND {cond} "
                                          "ORDER BY start_ts", (trace_id, *more))]

    def recent(self, *, limit: int = 100, before: tuple[float, str] | None = None,
               agent: str | None = None) -> list[Span]:
        """Newest first (then by span id); ``before``: only spans past that (start_ts, span_id) in this order, the
        position of the last span of a page; ``agent``: only that agent's spans (``of_agent``)."""
        conds: list[str] = []
        params: list[object] = []
        if before is not None:
            conds.append("(start_ts < ? OR (start_ts = ? AND span_id < ?))")
            params += [before[0], before[0], before[1]]
        if agent is not None:
            cond, more = of_agent(agent)
            conds.append(cond)
            params += more
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        with self._ts._tx(write=False) as c:
            return [_span(r) for r in c.q(f"SELECT {_SPAN_COLS} FROM spans {where} ORDER BY start_ts DESC, span_id DESC "
                                          "LIMIT ?", (*params, limit))]

    def forget_user(self, user: str, agent: str | None = None) -> int:
        """Delete the spans no scope holds (an HTTP request's, a share link's) that name ``user`` (of ``agent``, or
        of every agent) in their attributes: a forgotten user's requests leave no trace of them. Scoped spans go
        with their scope. Found through the index of the user each such span names (``user_id``, migration 21,
        which filled it in for the spans written before), so the cost is the user's spans, not every span kept."""
        with self._ts._tx() as c:
            if agent is None:
                return c.x("DELETE FROM spans WHERE user_id = ? AND scope IS NULL", (user,))
            return c.x("DELETE FROM spans WHERE user_id = ? AND (agent_id = ? OR agent_id IS NULL) AND scope IS NULL",
                       (user, agent))
