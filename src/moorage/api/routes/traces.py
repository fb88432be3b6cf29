"""Traces and usage of the caller's tenant: one trace by id, recent spans, usage totals and cost.

Spans live in the tenant's store, so another tenant's trace id is simply not found.
"""

from __future__ import annotations

from typing import Any

from moorage.api import schemas as S
from moorage.api.pagination import keyset_page, parse_limit, position
from moorage.api.routes._common import PAGE, agent_of_key, float_query
from moorage.api.routing import Call, Endpoint, Param
from moorage.errors import InvalidInput, NotFound


def get_trace(call: Call) -> dict[str, Any]:
    trace_id = call.path["trace_id"]
    # A key limited to one agent sees that agent's spans of the trace (none: not found, like another tenant's).
    spans = call.tenant.spans.trace(trace_id, agent=call.who.agent)
    if not spans:
        raise NotFound(f"no trace {trace_id!r}", hint="trace ids are returned in the X-Trace-Id header of each response")
    return {"trace_id": trace_id, "spans": [S.span(s) for s in spans]}


def recent_spans(call: Call) -> dict[str, Any]:
    # Keyed on the last span's (start_ts, span_id), not an offset: spans keep arriving (each API request makes
    # one, this listing's own included), and an offset would show the next page's first spans again.
    limit = parse_limit(call.query("limit"))
    pos = position(call.query("cursor"), {"t": (int, float), "s": str})
    agent = agent_of_key(call, "spans")  # as for workflow runs
    spans = call.tenant.spans.recent(limit=limit + 1, before=(float(pos["t"]), pos["s"]) if pos else None, agent=agent)
    return keyset_page(spans, limit, lambda s: {"t": s.start_ts, "s": s.span_id}, S.span)


def usage(call: Call) -> dict[str, Any]:
    since = float_query(call, "since") or 0.0
    until = float_query(call, "until")
    if until is not None and until < since:
        raise InvalidInput(f"until ({until}) is before since ({since})",
                           hint="until is the end of the window, exclusive: a later time than since")
    agent = agent_of_key(call, "usage")  # a key limited to one agent reads its agent's counts and costs only
    from moorage.usage.ledger import totals as ledger_totals

    totals = ledger_totals(call.tenant, since=since, until=until, agent=agent, user=call.query("user"))
    out: dict[str, Any] = {"since": since, "until": until, "totals": totals, "cost_usd": totals.get("cost_usd", 0.0)}
    if agent and call.query("user"):  # one end-user: their caps as the next turn's check counts them
        from moorage.store.model import check_id
        from moorage.usage.caps import standing

        ceiling = float(call.ctx.config.user_max_store_mib or 0)  # the operator's (a store-only server's too)
        out["caps"] = standing(call.tenant, check_id(agent, "agent name"), check_id(call.query("user"), "user id"),
                               store_ceiling=ceiling)
    if agent is None and call.query("user") is None:  # the whole tenant: what it keeps, under its ceiling
        from moorage.usage.tenant_cap import standing as storage_standing

        storage = storage_standing(call.ctx.config, call.tenant)
        if storage is not None:
            out["storage"] = storage
    group = call.query("group")
    if group not in (None, "", "day"):
        raise InvalidInput(f"group must be day, got {group!r}")
    if group == "day":
        from moorage.usage.ledger import by_day

        out["days"] = by_day(call.tenant, since=since, until=until, agent=agent, user=call.query("user"))
    return out


ENDPOINTS = [
    Endpoint("GET", "/v1/traces", recent_spans, "Recent spans, newest first", "observability", "listSpans", scope="read",
             agent_checked=True,
             query=(*PAGE, Param("agent", S.ID, "only this agent's spans (a key limited to one agent must name it)")),
             response=S.page_of("Span")),
    Endpoint("GET", "/v1/traces/{trace_id}", get_trace, "All spans of one trace", "observability", "getTrace", scope="read",
             agent_checked=True, response=S.ref("Trace")),
    Endpoint("GET", "/v1/usage", usage, "Usage totals and cost", "observability", "getUsage", scope="read",
             agent_checked=True,
             query=(Param("since", S.NUM, "seconds since the epoch"),
                    Param("until", S.NUM, "seconds since the epoch: the window's end, exclusive (none: no end)"),
                    Param("agent", S.ID, "only this agent's usage (a key limited to one agent must name it)"),
                    Param("user", S.STR, "only this end-user's usage; with agent, also their caps"),
                    Param("group", {"enum": ["day"]}, "also break the totals down by UTC day")),
             response=S.ref("Usage")),
]
