"""Paging a webhook's deliveries: several made in the same instant (one event for a burst of turns, a clock that
ticks coarsely) each appear on exactly one page."""

from __future__ import annotations

from moorage.store import Store


def test_deliveries_made_in_the_same_instant_are_each_on_one_page(live, acme: str, store: Store) -> None:  # noqa: ANN001
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("bot")
    hook = ts.webhooks.create("bot", "https://example.com/hooks", None, None)
    made = [ts.deliveries.enqueue("bot", "execution.succeeded", {"n": i}, at=1_800_000_000.0 + (i >= 3))[0].id
            for i in range(7)]  # three at one instant, then four at the next
    seen: list[str] = []
    with live.client(acme) as c:
        cursor = None
        for _ in range(10):
            r = c.get(f"/v1/agents/bot/webhooks/{hook.id}/deliveries", params={"limit": 2, **({"cursor": cursor} if cursor else {})})
            assert r.status_code == 200, r.text
            seen += [d["id"] for d in r.json()["data"]]
            cursor = r.json()["next_cursor"]
            if cursor is None:
                break
        assert sorted(seen) == sorted(made) and len(seen) == len(made)
        assert c.get(f"/v1/agents/bot/webhooks/{hook.id}/deliveries", params={"cursor": "eyJpZCI6ICJ4In0"}).status_code == 422
