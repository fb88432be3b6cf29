"""``fact.pending``: a fact an agent learns in a turn waits for confirmation, and the agent's webhooks subscribed
to the event are told so, signed (Standard Webhooks), with the fact and the turn it came from, through a real
runtime, HTTP server, delivery loop and receiver on loopback. Once per fact; never another tenant's webhook, never
a webhook that did not subscribe to it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from moorage.client import AsyncClient
from moorage.store import Store
from moorage.webhooks import Dispatcher, verify
from tests.api.conftest import agent_archive
from tests.api.test_async_webhooks import FAST, Receiver, until

LEARNS = '''
async def on_message(ctx, message):
    _, attribute, value = message.split(" ", 2)
    r = await ctx.memory.learn("user", attribute, value, f"the user's {attribute} is {value}")
    return r["status"]
'''

FIELDS = {"fact_id", "agent", "user", "session", "subject", "attribute", "value", "source", "trust", "status",
          "recorded_at", "valid_from", "run_id", "trace_id", "url"}


async def test_a_fact_the_agent_learns_is_announced_to_its_subscribers_only(
        live_rt, store: Store, acme: str, globex: str, tmp_path: Path) -> None:
    everything, interrupts_only, other_tenant = Receiver(), Receiver(), Receiver()
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    loop_task = asyncio.create_task(dispatcher.run())
    try:
        async with AsyncClient(live_rt.url, globex) as g:
            await g.deploy("pal", agent_archive(tmp_path, "pal", LEARNS))
            theirs = await g.create_webhook("pal", other_tenant.url)  # every event, fact.pending included
        async with AsyncClient(live_rt.url, acme) as sdk:
            await sdk.deploy("pal", agent_archive(tmp_path, "pal", LEARNS))
            hook = await sdk.create_webhook("pal", everything.url, events=["fact.pending"])
            await sdk.create_webhook("pal", interrupts_only.url, events=["interrupt.waiting"])
            await sdk.add_fact("pal", "ada", "user", "city", "Lisbon")  # what she said herself: not pending
            turn = await sdk.invoke("pal", "learn city Porto", user="ada", session="s1")
            assert turn["reply"] == "pending", turn
            again = await sdk.invoke("pal", "learn city Porto", user="ada")  # the same value: merged, no event
            assert again["reply"] == "pending", again
            (fact,) = (await sdk.list_pending_facts("pal", "ada"))["data"]

            await until(lambda: everything.delivered(), "the fact.pending delivery arrives")
            headers, body = everything.delivered()[0]
            event = verify(hook["secret"], body, headers)  # signed with this webhook's secret
            assert event["type"] == "fact.pending" and set(event["data"]) == FIELDS, event
            data = event["data"]
            assert data == {
                "fact_id": fact["id"], "agent": "pal", "user": "ada", "session": None, "subject": "user",
                "attribute": "city", "value": "Porto", "source": "agent", "trust": "model_inferred",
                "status": "pending", "recorded_at": fact["recorded_at"], "valid_from": fact["valid_from"],
                "run_id": turn["run_id"], "trace_id": turn["trace_id"],
                "url": "/v1/agents/pal/users/ada/facts/pending"}, data
            # What the receiver needs to decide it: the fact id the confirm route takes.
            assert (await sdk.confirm_fact("pal", "ada", data["fact_id"]))["fact"]["value"] == "Porto"

            # Another tenant's agent of the same name learns too: its own webhook hears of its own fact only.
        async with AsyncClient(live_rt.url, globex) as g:
            assert (await g.invoke("pal", "learn pet Rex", user="ada"))["reply"] == "pending"
        await until(lambda: other_tenant.delivered(), "the other tenant's own event arrives")
        await asyncio.sleep(0.5)  # more rounds of the loop: nothing else goes out
        assert len(everything.delivered()) == 1 and interrupts_only.requests == []
        (theirs_got,) = [verify(theirs["secret"], b, h) for h, b in other_tenant.delivered()]
        assert theirs_got["type"] == "fact.pending" and theirs_got["data"]["value"] == "Rex"
        assert "Porto" not in json.dumps(theirs_got) and fact["id"] != theirs_got["data"]["fact_id"]
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        for r in (everything, interrupts_only, other_tenant):
            r.close()


def test_zero_retention_scrubs_what_a_delivered_fact_pending_said(tenant) -> None:  # type: ignore[no-untyped-def]
    """An agent's purge (zero retention) keeps a delivered event's log entry but not the fact it told of, as it
    does for a turn's reply."""
    import time

    from moorage.memory import FactCandidate, SemanticMemory
    from moorage.store import Scope, zero_retention

    hook = tenant.webhooks.create("pal", "https://example.com/hooks")
    fact = SemanticMemory(tenant).record(Scope.for_user("pal", "ada"), FactCandidate(
        "ada", "email", "ada@example.org", "ada's email is ada@example.org"), origin="agent").fact
    (d,) = tenant.deliveries.list(hook.id)
    assert d.payload["data"]["value"] == "ada@example.org"
    tenant.deliveries.record_attempt(d, at=time.time(), status_code=204, error=None, duration_ms=1.0,
                                     delivered=True, retry_at=None)
    zero_retention.purge(tenant, "pal")
    kept = tenant.deliveries.get(d.id)
    assert kept.status == "delivered" and kept.payload["data"]["fact_id"] == fact.id
    assert "ada@example.org" not in json.dumps(kept.payload) and "email" not in json.dumps(kept.payload), kept.payload


def test_an_agent_with_zero_retention_announces_no_pending_fact(tenant) -> None:  # type: ignore[no-untyped-def]
    """Its facts are purged when the turn ends: a backend told of one would only meet a 404 confirming it."""
    from moorage.memory import FactCandidate, SemanticMemory
    from moorage.store import Scope, zero_retention

    for name in ("keeps", "forgets"):
        tenant.agents.create(name, {})
        tenant.webhooks.create(name, f"https://example.com/hooks/{name}")
    zero_retention.set_zero(tenant, "forgets", True)
    for name in ("keeps", "forgets"):
        SemanticMemory(tenant).record(Scope.for_user(name, "ada"), FactCandidate(
            "ada", "email", "ada@example.org", "ada's email is ada@example.org"), origin="agent")
    sent = {r[0] for r in tenant.read("SELECT agent_id FROM webhook_deliveries")}
    assert sent == {"keeps"}
