"""Listing a user's memory over HTTP pages through all of it, however much there is."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Scope, Store
from tests.api.conftest import aclient


async def test_facts_pages_reach_past_ten_thousand_rows(live, store: Store, acme: str, tmp_path: Path) -> None:
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")
    scope = Scope.for_user("pal", "ada")
    n = 10_003
    with ts.transaction():  # a multi-valued attribute: every value stays current
        for i in range(n):
            ts.facts.insert(scope, "user", "likes", f"thing {i:05d}", f"I like thing {i}")
    seen: list[str] = []
    cursor = None
    async with aclient(live, acme) as c:
        while True:
            r = await c.get("/v1/agents/pal/users/ada/facts", params={"limit": 500, **({"cursor": cursor} if cursor else {})})
            assert r.status_code == 200, r.text
            body = r.json()
            seen += [f["value"] for f in body["data"]]
            cursor = body["next_cursor"]
            if cursor is None:
                break
    assert len(seen) == n and len(set(seen)) == n


async def test_a_bad_k_on_search_names_k(live, store: Store, acme: str) -> None:
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")
    ts.agent_users.put("pal", "ada")  # a user of the agent, who has nothing to recall yet
    async with aclient(live, acme) as c:
        for k in ("0", "501", "many"):
            r = await c.get("/v1/agents/pal/users/ada/events/search", params={"q": "city", "k": k})
            assert r.status_code == 422 and r.json()["detail"].startswith("k must be"), r.text
        assert (await c.get("/v1/agents/pal/users/ada/events/search", params={"q": "city", "k": "3"})).status_code == 200


async def test_searches_over_http_reuse_the_scopes_index(live_rt, runtime, store: Store, acme: str, monkeypatch) -> None:
    # Each search built the scope's vectors and BM25 index from scratch (0.35 s at 20k events, against 5 ms warm).
    from moorage.memory import episodic_index

    built: list[object] = []

    class Counted(episodic_index._ScopeVectors):
        def __init__(self) -> None:
            super().__init__()
            built.append(self)

    monkeypatch.setattr(episodic_index, "_ScopeVectors", Counted)
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")
    ts.events.append(Scope.for_user("pal", "ada"), "note", "the spare key is under the blue flowerpot", speaker="agent")
    async with aclient(live_rt, acme) as c:
        for _ in range(3):
            r = await c.get("/v1/agents/pal/users/ada/events/search", params={"q": "where is the spare key"})
            assert r.status_code == 200 and "flowerpot" in r.json()["data"][0]["event"]["content"], r.text
    assert len(built) == 1


async def test_adding_a_fact_for_a_user_the_agent_does_not_have_is_a_404(live, store: Store, acme: str) -> None:
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")  # end-users are created explicitly (the default)
    ts.agents.create("open", {"lifecycle": {"users": "auto"}})
    fact = {"subject": "user", "attribute": "city", "value": "Lisbon"}
    async with aclient(live, acme) as c:
        r = await c.post("/v1/agents/pal/users/adaa/facts", json=fact)  # a typo of ada
        assert r.status_code == 404 and "adaa" in r.json()["detail"], r.text
        assert ts.facts.list(Scope.for_user("pal", "adaa"), include_closed=True) == []
        assert (await c.put("/v1/agents/pal/users/ada", json={})).status_code == 201
        assert (await c.post("/v1/agents/pal/users/ada/facts", json=fact)).status_code == 201
        # An agent whose users come with their first use: the fact's user is one of its users now (listed, erasable).
        assert (await c.post("/v1/agents/open/users/bo/facts", json=fact)).status_code == 201
        users = (await c.get("/v1/agents/open/users")).json()["data"]
        assert [u["id"] for u in users] == ["bo"], users
        assert (await c.post("/v1/agents/open/users/cy/facts", json={**fact, "value": "x" * 300_000})).status_code == 422
        assert [u["id"] for u in (await c.get("/v1/agents/open/users")).json()["data"]] == ["bo"]


async def test_events_read_back_from_the_newest_page_by_page(live, store: Store, acme: str) -> None:
    # A support person reads a long log from its end: newest first, each page older than the last, nothing twice
    # even while the user keeps talking; `kind` picks the summaries out of it.
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal")
    scope = Scope.for_user("pal", "ada")
    with ts.transaction():
        for i in range(1203):
            ts.events.append(scope, "summary" if i % 100 == 7 else "message", f"event {i}", speaker="user")
    seen: list[str] = []
    cursor = None
    async with aclient(live, acme) as c:
        while True:
            r = await c.get("/v1/agents/pal/users/ada/events",
                            params={"order": "newest", "limit": 500, **({"cursor": cursor} if cursor else {})})
            assert r.status_code == 200, r.text
            seen += [e["content"] for e in r.json()["data"]]
            cursor = r.json()["next_cursor"]
            ts.events.append(scope, "message", f"later {len(seen)}", speaker="user")  # newer: not on older pages
            if cursor is None:
                break
        assert seen == [f"event {i}" for i in reversed(range(1203))]
        r = await c.get("/v1/agents/pal/users/ada/events", params={"order": "newest", "kind": "summary", "limit": 1})
        assert [e["content"] for e in r.json()["data"]] == ["event 1107"]
        first = (await c.get("/v1/agents/pal/users/ada/events", params={"limit": 1})).json()
        assert first["data"][0]["content"] == "event 0"  # the default order is unchanged
        r = await c.get("/v1/agents/pal/users/ada/events", params={"order": "newest", "cursor": first["next_cursor"]})
        assert r.status_code == 422 and "same order" in r.json()["hint"], r.text
        r = await c.get("/v1/agents/pal/users/ada/events", params={"order": "latest"})
        assert r.status_code == 422 and "order must be oldest or newest" in r.json()["detail"], r.text
