"""``GET /v1/sandboxes`` pages by position, not offset: one instance per end-user, so a tenant with more than
10,000 users had instances the listing never reached (it read 10,000 and paged through those), and a page deep in
the listing read every row before it."""

from __future__ import annotations

from typing import Any

import httpx

from moorage.store import Scope, Store
from tests.api.conftest import LiveServer


def _insert(store: Store, secret: str, agent: str, n: int, start: float) -> list[str]:
    """``n`` sleeping instances of ``agent``, one per user, in one transaction (what a busy agent has)."""
    ts = store.tenant(store.authenticate(secret))
    ids = [f"{agent}-sbx-{i:05d}" for i in range(n)]
    with ts._tx() as c:
        for i, sid in enumerate(ids):
            c.x("INSERT INTO sandboxes (id, agent_id, scope, state, host, snapshot_ref, disk_ref, template_ref, "
                "last_active, ttl_s, meta, created_at, version, lease_epoch) "
                "VALUES (?, ?, ?, 'sleeping', NULL, NULL, NULL, NULL, ?, NULL, '{}', ?, 1, 0)",
                (sid, agent, Scope.for_user(agent, f"u{i:05d}").key, start + i, start + i))
    return ids


def _walk(c: httpx.Client, params: dict[str, Any], limit: int) -> list[str]:
    ids: list[str] = []
    cursor = None
    while True:
        r = c.get("/v1/sandboxes", params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        ids += [b["id"] for b in r.json()["data"]]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return ids


def test_every_instance_is_listed_past_ten_thousand(live: LiveServer, store: Store, acme: str) -> None:
    many = _insert(store, acme, "busy", 10_020, 1_000.0)
    late = _insert(store, acme, "late", 3, 50_000.0)  # the most recently active
    with live.client(acme) as c:
        assert _walk(c, {"agent": "late"}, 2) == late
        every = _walk(c, {"state": "sleeping"}, 500)
        assert every == many + late  # least recently active first, each once
        r = c.get("/v1/sandboxes", params={"cursor": "eyJhIjp0cnVlLCJpIjoieCJ9"})  # {"a":true,"i":"x"}
        assert r.status_code == 422 and "cursor" in r.json()["detail"], r.text
