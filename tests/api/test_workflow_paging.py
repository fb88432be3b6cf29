"""``GET /v1/workflows`` pages by position, not offset: every run of an agent is reachable however many runs the
tenant has (each turn is a run: an active tenant has tens of thousands), runs that start while a client pages do
not push earlier ones onto the next page."""

from __future__ import annotations

from typing import Any

import httpx

from moorage.store import Scope, Store
from tests.api.conftest import LiveServer


def _insert_runs(store: Store, secret: str, agent: str, n: int, *, status: str = "succeeded",
                 start: float = 1_000_000.0, tag: str = "run") -> list[str]:
    """``n`` finished turn runs of ``agent`` in one transaction (what months of turns leave)."""
    ts = store.tenant(store.authenticate(secret))
    ids = [f"{agent}-{tag}-{i:05d}" for i in range(n)]
    with ts._tx() as c:
        for i, rid in enumerate(ids):
            c.x("INSERT INTO workflow_runs (id, scope, name, status, input, state, current_step, result, error, "
                "created_at, updated_at, version) VALUES (?, ?, 'turn', ?, '{}', '{}', NULL, NULL, NULL, ?, ?, 1)",
                (rid, Scope.workflow(agent, rid, "ada").key, status, start + i, start + i))
    return ids


def _all(c: httpx.Client, query: dict[str, str], limit: int) -> tuple[list[str], int]:
    ids: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {**query, "limit": limit}
        if cursor:
            params["cursor"] = cursor
        r = c.get("/v1/workflows", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        ids += [run["id"] for run in body["data"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            return ids, pages


def test_an_agents_runs_are_all_listed_past_ten_thousand_of_another(live: LiveServer, store: Store, acme: str) -> None:
    _insert_runs(store, acme, "busy", 10_050)
    mine = _insert_runs(store, acme, "quiet", 3, start=2_000_000.0)  # the newest runs of the tenant
    with live.client(acme) as c:
        ids, _ = _all(c, {"agent": "quiet"}, 2)
        assert ids == mine
        # An agent whose id is another's prefix is not listed with it.
        assert _all(c, {"agent": "qui"}, 50)[0] == []
        assert _all(c, {"agent": "quiet", "status": "failed"}, 50)[0] == []


def test_paging_neither_skips_nor_repeats_while_runs_start(live: LiveServer, store: Store, acme: str) -> None:
    first = _insert_runs(store, acme, "a", 30)
    with live.client(acme) as c:
        r = c.get("/v1/workflows", params={"limit": 10}).json()
        seen = [run["id"] for run in r["data"]]
        later = _insert_runs(store, acme, "a", 5, start=500.0, tag="late")  # runs whose last change sorts before the page's
        cursor = r["next_cursor"]
        while cursor:
            r = c.get("/v1/workflows", params={"limit": 10, "cursor": cursor}).json()
            seen += [run["id"] for run in r["data"]]
            cursor = r["next_cursor"]
    assert seen == first  # the earlier-sorting newcomers did not shift any run onto a page already read
    assert not set(later) & set(seen)


def test_a_malformed_cursor_is_a_clear_error(live: LiveServer, acme: str) -> None:
    with live.client(acme) as c:
        for bad in ("not-base64!", "eyJ1IjoieCJ9"):  # the second: {"u":"x"}
            r = c.get("/v1/workflows", params={"cursor": bad})
            assert r.status_code == 422 and "cursor" in r.json()["detail"], r.text
