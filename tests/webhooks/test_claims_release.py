"""The claims a killed sender held (``moorage.webhooks.claims.HeldClaims``), released at the next start on both store
backends: due at once if still as claimed, untouched once another sender claimed it or an attempt was recorded."""

from __future__ import annotations

import time
from pathlib import Path

from moorage.store import Store, TenantStore
from moorage.webhooks.claims import HeldClaims


def test_only_claims_still_as_the_dead_sender_left_them_are_released(store: Store, tenant: TenantStore,
                                                                     tmp_path: Path) -> None:
    tenant.webhooks.create("a", "https://example.com/hook", ["execution.succeeded"])
    for n in range(3):
        tenant.deliveries.enqueue("a", "execution.succeeded", {"user": f"u{n}"})
    now = time.time()
    mine = tenant.deliveries.claim_due(now, 15.0)
    assert len(mine) == 3
    held = HeldClaims(tmp_path / "webhook-claims.json")
    held.hold(tenant.tenant_id, mine)
    delivered, retried, left = mine
    # Before the process died, two attempts were recorded: one delivered, one failed and due again in 30 s.
    tenant.deliveries.record_attempt(delivered, at=now, status_code=204, error=None, duration_ms=1.0,
                                     delivered=True, retry_at=None)
    tenant.deliveries.record_attempt(retried, at=now, status_code=500, error="receiver answered 500",
                                     duration_ms=1.0, delivered=False, retry_at=now + 30)

    assert HeldClaims(tmp_path / "webhook-claims.json").release_left(store) == 1
    assert not (tmp_path / "webhook-claims.json").exists()
    assert tenant.deliveries.get(left.id).next_at <= time.time()  # due at once, not in 15 s
    assert tenant.deliveries.get(retried.id).next_at == now + 30  # its retry is not brought forward
    assert tenant.deliveries.get(delivered.id).status == "delivered"
    assert [d.id for d in tenant.deliveries.claim_due(time.time(), 15.0)] == [left.id]
    # Another sender's claim after the lease (a version the dead one never saw) is not released either.
    (again,) = tenant.deliveries.claim_due(time.time() + 16, 15.0)
    held.hold(tenant.tenant_id, [left])
    assert HeldClaims(tmp_path / "webhook-claims.json").release_left(store) == 0
    assert tenant.deliveries.get(left.id).next_at == again.next_at
