"""An agent's sessions list, most recently active first, pages through all of them (the listing stopped at 10,000),
and a session that is active again during the walk is not listed twice. Both store backends."""

from __future__ import annotations

from moorage.client import AsyncClient
from moorage.store import Store
from tests.api.conftest import aclient

N = 10_040
ROWS = [(f"s{i:05d}", "pal", f"u{i % 97}", 1000.0 + i // 3, 1000.0 + i // 3, "{}", 1) for i in range(N)]
#: The listing's order: most recently active first, ties by user then id (descending).
NEWEST = [r[0] for r in sorted(ROWS, key=lambda r: (r[4], r[2], r[0]), reverse=True)]


def _fill(store: Store, secret: str) -> None:
    ts = store.tenant(store.authenticate(secret))
    ts.agents.create("pal")
    # Three at a time share a last_active (opened in the same instant): the cursor breaks the tie by user and id.
    with ts.transaction():
        ts.ambient().many("INSERT INTO sessions (id, agent_id, user_id, created_at, last_active, meta, version) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?)", ROWS)


async def test_sessions_page_past_ten_thousand_and_none_twice_while_active(live, store: Store, acme: str) -> None:
    _fill(store, acme)
    ts = store.tenant(store.authenticate(acme))
    seen: list[str] = []
    touched: set[str] = set()
    async with AsyncClient(live.url, acme) as sdk:
        cursor = None
        while True:
            page = await sdk.list_sessions("pal", limit=500, cursor=cursor)
            seen += [s["id"] for s in page["data"]]
            if len(seen) == 1000:  # users keep talking: one seen session and one not yet reached become the newest
                for sid in (seen[10], "s00100"):
                    user = f"u{int(sid[1:]) % 97}"
                    ts.sessions.open("pal", user, sid)
                    touched.add(sid)
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert len(seen) == len(set(seen))  # none twice
        assert [x for x in seen if x not in touched] == [x for x in NEWEST if x in set(seen) - touched]
        assert set(seen) >= {f"s{i:05d}" for i in range(N)} - touched  # every session not active meanwhile
        # Most recently active first, as the first page after the walk shows (the two just touched lead it).
        first = (await sdk.list_sessions("pal", limit=3))["data"]
        assert {s["id"] for s in first[:2]} == touched
        assert first[2]["id"] == NEWEST[0] and first[0]["last_active"] >= first[1]["last_active"]
        # One user's sessions page the same way.
        mine = [s["id"] async for s in sdk.paginate(sdk.list_sessions, "pal", user="u5", limit=7)]
        assert sorted(mine) == sorted(f"s{i:05d}" for i in range(N) if i % 97 == 5)


async def test_an_offset_cursor_from_before_still_pages_and_a_malformed_one_is_refused(
        live, store: Store, acme: str) -> None:
    _fill(store, acme)
    async with aclient(live, acme) as c:
        # The cursor an earlier version gave out ({"o": 20}): that page, then keyed cursors on.
        r = await c.get("/v1/agents/pal/sessions", params={"limit": 10, "cursor": "eyJvIjoyMH0"})
        assert r.status_code == 200, r.text
        assert [s["id"] for s in r.json()["data"]] == NEWEST[20:30]
        nxt = await c.get("/v1/agents/pal/sessions", params={"limit": 10, "cursor": r.json()["next_cursor"]})
        assert [s["id"] for s in nxt.json()["data"]] == NEWEST[30:40]
        for bad in ("eyJiZWZvcmUiOiA3fQ", "eyJvIjogLTF9"):  # {"before": 7}, {"o": -1}
            r = await c.get("/v1/agents/pal/sessions", params={"cursor": bad})
            assert r.status_code == 422 and "cursor" in r.json()["detail"], r.text
