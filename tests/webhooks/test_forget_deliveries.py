"""The webhook outbox keeps what it sent: a turn's reply, a fact an agent learned, each about one end-user. Forgetting
the user removed none of it (and pending ones still went out afterwards); deleting a webhook left its deliveries
unreachable for ever; and nothing ever expired them. Forget removes a user's deliveries with their attempts, a
deleted webhook takes its deliveries along, and a ``webhooks`` retention TTL sweeps settled ones. Both stores."""

from __future__ import annotations

from moorage.store import TenantStore


def _hooks(ts: TenantStore) -> tuple[str, str]:
    a = ts.webhooks.create("bot", "https://hooks.example.com/a").id
    b = ts.webhooks.create("other", "https://hooks.example.com/b").id
    return a, b


def _enqueue(ts: TenantStore, agent: str, user: str, reply: str, at: float) -> list[str]:
    out = ts.deliveries.enqueue(agent, "execution.succeeded",
                                {"execution_id": f"ex-{user}-{reply}", "agent": agent, "user": user, "reply": reply},
                                at=at)
    return [d.id for d in out]


def _payloads(ts: TenantStore) -> list[str]:
    return sorted(r[0] for r in ts.read("SELECT payload FROM webhook_deliveries"))


def test_forgetting_a_user_removes_the_deliveries_about_them(tenant: TenantStore) -> None:
    _hooks(tenant)
    (sent,) = _enqueue(tenant, "bot", "ada", "ada's secret plan", 100.0)
    _enqueue(tenant, "bot", "ada", "pending about ada", 200.0)
    _enqueue(tenant, "other", "ada", "ada with another agent", 300.0)
    _enqueue(tenant, "bot", "bob", "bob's reply", 400.0)
    with tenant._tx() as c:  # one of them delivered, with its attempt
        c.x("UPDATE webhook_deliveries SET status = 'delivered', attempts = 1 WHERE id = ?", (sent,))
        c.x("INSERT INTO webhook_attempts (delivery_id, seq, at, status_code, error, duration_ms) "
            "VALUES (?, 1, 100.5, 200, NULL, 3.0)", (sent,))
    tenant.forget_user("ada", "bot")
    left = _payloads(tenant)
    assert not any("secret plan" in p or "pending about ada" in p for p in left), left
    assert any("ada with another agent" in p for p in left) and any("bob's reply" in p for p in left)
    assert tenant.read("SELECT count(*) FROM webhook_attempts")[0][0] == 0
    due = tenant.deliveries.claim_due(10_000.0, 30.0)  # what would still go out: nothing about ada of bot
    assert due and all((d.payload["data"]["user"], d.payload["data"]["agent"]) != ("ada", "bot") for d in due)
    tenant.forget_user("ada")  # every agent
    assert [p for p in _payloads(tenant) if "ada" in p] == []


def test_a_deleted_webhook_takes_its_deliveries_along(tenant: TenantStore) -> None:
    a, b = _hooks(tenant)
    (d,) = _enqueue(tenant, "bot", "ada", "x", 100.0)
    _enqueue(tenant, "other", "ada", "y", 100.0)
    with tenant._tx() as c:
        c.x("INSERT INTO webhook_attempts (delivery_id, seq, at, status_code, error, duration_ms) "
            "VALUES (?, 1, 100.5, 500, 'receiver answered 500', 3.0)", (d,))
    tenant.webhooks.delete(a)
    assert [r[0] for r in tenant.read("SELECT webhook_id FROM webhook_deliveries")] == [b]
    assert tenant.read("SELECT count(*) FROM webhook_attempts")[0][0] == 0


def test_the_webhooks_retention_kind_sweeps_settled_deliveries(tenant: TenantStore) -> None:
    _hooks(tenant)
    old, old_pending = _enqueue(tenant, "bot", "ada", "old", 100.0)[0], _enqueue(tenant, "bot", "ada", "wait", 100.0)[0]
    new = _enqueue(tenant, "bot", "ada", "new", 10_000.0)[0]
    with tenant._tx() as c:
        c.x("UPDATE webhook_deliveries SET status = 'delivered', updated_at = 100.0 WHERE id = ?", (old,))
        c.x("UPDATE webhook_deliveries SET status = 'delivered', updated_at = 10000.0 WHERE id = ?", (new,))
    tenant.retention.set("webhooks", 3600.0)
    assert tenant.retention.sweep_records(10_500.0) == 1
    assert sorted(r[0] for r in tenant.read("SELECT id FROM webhook_deliveries")) == sorted([old_pending, new])
