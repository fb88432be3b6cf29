"""What a webhook says about an async turn: every event names the run (``run_id``, what an answer needs) and the
turn's trace, as a synchronous turn's ``interrupt.waiting`` does, so a receiver answers an approval from the event
alone and reads one shape for every event."""

from __future__ import annotations

from typing import Any

from moorage.durable import DurableEngine
from moorage.store import Scope, TenantStore
from moorage.webhooks.delivery import announce

FIELDS = {"execution_id", "run_id", "agent", "user", "session", "status", "reply", "error", "interrupt", "trace_id",
          "url"}


def _events(ts: TenantStore, hook_id: str) -> list[dict[str, Any]]:
    return [d.payload for d in reversed(ts.deliveries.list(hook_id))]


async def test_async_turn_events_name_the_run_and_the_trace(tenant: TenantStore) -> None:
    hook = tenant.webhooks.create("bot", "https://example.com/hooks", None, None)
    ex, _ = tenant.executions.create("ex1", "bot", "cust-1", "default", {"message": "approve", "idempotency_key": "k"})

    async def turn(ctx: Any, input: Any) -> Any:
        answer = await ctx.interrupt({"question": "ship it?"})
        return {"reply": f"answered {answer}", "trace_id": "trace-of-the-answer"}

    engine = DurableEngine(tenant, {"turn": turn})
    run = await engine.start(Scope.workflow("bot", ex.id, "cust-1"), "turn",
                             input={"message": "approve", "session": "default", "trace_id": "trace-of-the-turn"},
                             run_id=ex.id)
    assert run.status == "waiting"
    announce(tenant)
    await engine.answer(run.id, "yes")
    announce(tenant)

    waiting, done = _events(tenant, hook.id)
    assert waiting["type"] == "interrupt.waiting" and set(waiting["data"]) == FIELDS
    assert waiting["data"]["run_id"] == run.id and waiting["data"]["trace_id"] == "trace-of-the-turn"
    assert waiting["data"]["interrupt"] == {"question": "ship it?"} and waiting["data"]["url"] == "/v1/executions/ex1"
    assert done["type"] == "execution.succeeded" and set(done["data"]) == FIELDS
    assert done["data"]["run_id"] == run.id and done["data"]["trace_id"] == "trace-of-the-answer"
    assert done["data"]["reply"] == "answered yes"


def test_a_refused_execution_event_has_the_same_fields(tenant: TenantStore) -> None:
    hook = tenant.webhooks.create("bot", "https://example.com/hooks", None, None)
    ex, _ = tenant.executions.create("ex2", "bot", "cust-1", "default", {"message": "m", "idempotency_key": "k2"})
    tenant.executions.add_events(ex.id, [{"kind": "error", "data": {"detail": "no such user"}, "at": 0.0}])
    announce(tenant)
    (failed,) = _events(tenant, hook.id)
    assert failed["type"] == "execution.failed" and set(failed["data"]) == FIELDS
    assert failed["data"]["run_id"] is None and failed["data"]["error"] == "no such user"


def test_a_new_execution_is_announced_behind_more_than_a_page_of_waiting_ones(tenant: TenantStore) -> None:
    """A tenant with more turns waiting for an answer than one page of the outbox's scan (200) still has its new
    executions announced: the scan reads every page, not the oldest 200 only."""
    hook = tenant.webhooks.create("bot", "https://example.com/hooks", None, None)
    with tenant.transaction():
        for i in range(205):  # waiting for an answer (announced as such), oldest first
            ex, _ = tenant.executions.create(f"old{i:03}", "bot", f"u{i}", "default", {"message": "approve"})
            assert tenant.executions.mark_announced(ex.id, "waiting", expected_version=ex.version)
    ex, _ = tenant.executions.create("new", "bot", "cust-1", "default", {"message": "m"})
    tenant.executions.add_events(ex.id, [{"kind": "error", "data": {"detail": "refused"}, "at": 0.0}])
    announce(tenant)
    assert [p["data"]["execution_id"] for p in _events(tenant, hook.id)] == ["new"]
