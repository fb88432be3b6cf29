"""The ``fact.pending`` webhook event: a fact an agent learned (or a tool said) waits for someone to confirm it.

Queued into the tenant's outbox by ``memory.semantic`` in the transaction that records the fact, so it is sent
exactly when the fact exists, once per fact (the same value learned again merges into it and is not announced).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from moorage.store import Fact, TenantStore
from moorage.store.webhooks import Delivery

#: The event's name (``store.webhooks.WEBHOOK_EVENTS`` lists it for subscriptions).
FACT_PENDING = "fact.pending"


def pending_url(fact: Fact) -> str:
    """Where the fact is listed, confirmed and rejected (the session's facts carry ``?session=``)."""
    s = fact.scope
    url = f"/v1/agents/{quote(s.agent, safe='')}/users/{quote(s.user or '', safe='')}/facts/pending"
    return url + (f"?session={quote(s.ref, safe='')}" if s.kind == "session" and s.ref else "")


def fact_data(fact: Fact, *, run_id: str | None = None, trace_id: str | None = None) -> dict[str, Any]:
    """What ``fact.pending`` says: the fact (``fact_id`` is what ``POST …/facts/{fact}/confirm`` takes), who it is
    about, where it came from and how far it is trusted, and the turn it was learned in (null when none)."""
    s = fact.scope
    return {"fact_id": fact.id, "agent": s.agent, "user": s.user,
            "session": s.ref if s.kind == "session" else None,
            "subject": fact.subject, "attribute": fact.attribute, "value": fact.value,
            "source": fact.source, "trust": fact.trust, "status": fact.status,
            "recorded_at": fact.recorded_at, "valid_from": fact.valid_from,
            "run_id": run_id, "trace_id": trace_id,
            "url": pending_url(fact)}


def announce_pending(ts: TenantStore, fact: Fact, *, run_id: str | None = None,
                     trace_id: str | None = None) -> list[Delivery]:
    """Queue ``fact.pending`` for each webhook of the fact's agent subscribed to it; joins the caller's
    transaction (the one that records the fact). Not for an agent with zero retention: its facts are purged when
    the turn ends, so a backend told of one could only meet a 404 confirming it."""
    from moorage.errors import NotFound
    from moorage.store.zero_retention import is_zero

    try:
        if is_zero(ts.agents.get(fact.scope.agent)):
            return []
    except NotFound:
        pass  # facts recorded for an agent not deployed (the store's own tests): announced as any other
    return ts.deliveries.enqueue(fact.scope.agent, FACT_PENDING, fact_data(fact, run_id=run_id, trace_id=trace_id))
