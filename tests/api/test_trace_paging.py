"""``GET /v1/traces`` pages by position, not offset: spans keep arriving while a client pages (every API request
records one, the listing's own included), and an offset would show spans of the page already read again."""

from __future__ import annotations

from typing import Any

import httpx

from moorage.store import Span, Store
from tests.api.conftest import LiveServer


def _record(store: Store, secret: str, n: int, *, start: float, same_time: bool = False) -> list[str]:
    ts = store.tenant(store.authenticate(secret))
    ids = [f"old{i:04d}" for i in range(n)]
    for i, sid in enumerate(ids):
        t = start if same_time else start + i
        ts.spans.record(Span("t" * 32, sid, None, "turn", t, t + 0.01, "ok", {}, None))
    return ids


def _page(c: httpx.Client, cursor: str | None, limit: int) -> dict[str, Any]:
    r = c.get("/v1/traces", params={"limit": limit, **({"cursor": cursor} if cursor else {})})
    assert r.status_code == 200, r.text
    return r.json()


def test_paging_while_requests_add_spans_repeats_none(live: LiveServer, store: Store, acme: str) -> None:
    old = _record(store, acme, 30, start=1_000.0)  # long before this test's own requests
    seen: list[str] = []
    with live.client(acme) as c:
        body = _page(c, None, 10)
        while True:
            seen += [s["span_id"] for s in body["data"]]
            for _ in range(4):  # other requests meanwhile: each a new, newer span
                assert c.get("/v1/whoami").status_code == 200
            if body["next_cursor"] is None:
                break
            body = _page(c, body["next_cursor"], 10)
    assert len(seen) == len(set(seen)), "a span was listed twice"
    assert [s for s in seen if s.startswith("old")] == list(reversed(old))  # every one, newest first


def test_spans_of_one_instant_are_each_listed_once(live: LiveServer, store: Store, acme: str) -> None:
    same = _record(store, acme, 25, start=500.0, same_time=True)
    seen: list[str] = []
    with live.client(acme) as c:
        cursor = None
        while True:
            body = _page(c, cursor, 7)
            seen += [s["span_id"] for s in body["data"] if s["span_id"].startswith("old")]
            cursor = body["next_cursor"]
            if cursor is None:
                break
        assert sorted(seen) == same and len(seen) == 25
        r = c.get("/v1/traces", params={"cursor": "eyJvIjoiMSJ9"})  # {"o":"1"}: not a position
        assert r.status_code == 422 and "cursor" in r.json()["detail"]
