"""A fact write reads only the rows it can touch (the same value's rows, the attribute's current value), on both
store backends: same answers as reading them all, including rows written without their comparable form."""

from __future__ import annotations

from moorage.memory.extraction import FactCandidate, normalize_value
from moorage.memory.semantic import SemanticMemory
from moorage.store import Scope, TenantStore

T0 = 1_700_000_000.0
BOB = Scope.for_user("concierge", "bob")


def _learn(mem: SemanticMemory, value: str, *, origin: str = "agent", attribute: str = "last_turn", at: float = T0):
    return mem.record(BOB, FactCandidate("user", attribute, value, f"{attribute} is {value}"), origin=origin,  # type: ignore[arg-type]
                      evidence=[value], valid_from=at)


def _keys(ts: TenantStore) -> dict[str, str | None]:
    return {r[0]: r[1] for r in ts.read("SELECT id, value_key FROM facts")}


def test_an_agent_value_seen_long_ago_merges_into_its_pending_row(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    first = _learn(mem, "The Harbour", at=T0)
    assert first.action == "pending"
    for n in range(40):  # many other values pile up as pending rows
        assert _learn(mem, f"value {n}", at=T0 + n + 1).action == "pending"
    again = _learn(mem, "  harbour!", at=T0 + 100)  # the same value by its comparable form
    assert again.action == "merged" and again.fact.id == first.fact.id
    assert again.fact.provenance == ("The Harbour", "  harbour!")
    assert len(mem.pending(BOB)) == 41
    # Written with the row: its comparable form.
    assert _keys(tenant)[first.fact.id] == normalize_value("The Harbour")


def test_rows_without_their_form_are_found_and_given_it(tenant: TenantStore) -> None:
    """Rows written before the form was stored, or restored from a checkpoint image, have none (NULL)."""
    mem = SemanticMemory(tenant)
    pending = _learn(mem, "Lisbon", at=T0)
    active = _learn(mem, "Green", origin="user", attribute="colour", at=T0)
    legacy = tenant.facts.insert(BOB, "user", "colour", "Blue", "colour is Blue", valid_from=T0 - 10, status="pending",
                                 trust="model_inferred", source="agent")  # a caller without the form
    with tenant.transaction():
        tenant.ambient().x("UPDATE facts SET value_key = NULL")  # type: ignore[union-attr]
    assert set(_keys(tenant).values()) == {None}

    assert _learn(mem, "lisbon.", at=T0 + 1).fact.id == pending.fact.id
    merged = _learn(mem, "the green", origin="user", attribute="colour", at=T0 + 1)
    assert merged.action == "merged" and merged.fact.id == active.fact.id
    assert _learn(mem, "BLUE", attribute="colour", at=T0 + 1).fact.id == legacy.id
    # Each row looked at got its form; the fact itself did not change (same version as the merge left it).
    keys = _keys(tenant)
    assert keys == {pending.fact.id: "lisbon", active.fact.id: "green", legacy.id: "blue"}
    assert tenant.facts.get(legacy.id).version == 2


def test_current_matching_reads_only_current_rows_of_one_status(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    old = _learn(mem, "Paris", origin="user", attribute="city", at=T0).fact
    new = _learn(mem, "Berlin", origin="user", attribute="city", at=T0 + 10)
    assert new.action == "superseded"
    waiting = _learn(mem, "Paris", origin="agent", attribute="city", at=T0 + 20)
    assert waiting.action == "pending"  # the closed Paris row is history, not a current value to merge into
    other = _learn(mem, "Paris", origin="user", attribute="home", at=T0).fact

    def ids(status: str, key: str, attribute: str = "city") -> list[str]:
        return [f.id for f in tenant.facts.current_matching(BOB, "user", attribute, status=status, key=key,
                                                             keyer=normalize_value)]

    assert ids("active", "paris") == []
    assert ids("pending", "paris") == [waiting.fact.id]
    assert ids("active", "berlin") == [new.fact.id]
    assert ids("active", "paris", "home") == [other.id]
    assert [f.id for f in tenant.facts.current(BOB, "user", "city")] == [new.fact.id]
    assert [f.id for f in tenant.facts.current(BOB, "user", "city", status="pending")] == [waiting.fact.id]
    assert old.id not in {f.id for f in tenant.facts.current(BOB, "user", "city")}


def test_a_user_value_supersedes_the_one_current_value_among_many_closed(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    for n in range(30):
        ch = _learn(mem, f"mood {n}", origin="user", attribute="mood", at=T0 + n)
        assert ch.action == ("inserted" if n == 0 else "superseded")
    [current] = mem.recall(BOB, attribute="mood")
    assert current.value == "mood 29"
    assert len(mem.history(BOB, "user", "mood")) == 30
    # Multi-valued: each new value is one more current value; a repeat merges.
    assert _learn(mem, "tea", origin="user", attribute="likes").action == "inserted"
    assert _learn(mem, "coffee", origin="user", attribute="likes").action == "inserted"
    assert _learn(mem, "Tea", origin="user", attribute="likes").action == "merged"
    assert sorted(f.value for f in mem.recall(BOB, attribute="likes")) == ["coffee", "tea"]


def test_after_a_rollback_and_a_copy_the_same_value_still_merges(tenant: TenantStore) -> None:
    """A checkpoint images a fact's own columns: rows it restores or copies come back without their form."""
    from moorage.store.repos.checkpoints import Checkpoints

    mem = SemanticMemory(tenant)
    cps = Checkpoints(tenant)
    first = _learn(mem, "Harbour", at=T0)
    ck = cps.take("concierge", "bob")
    _learn(mem, "Lighthouse", at=T0 + 1)
    cps.rollback("concierge", "bob", ck.id)
    assert [f.value for f in mem.pending(BOB)] == ["Harbour"]
    again = _learn(mem, "the harbour", at=T0 + 2)
    assert again.action == "merged" and again.fact.id == first.fact.id

    cps.copy_to_user("concierge", "bob", ck.id, "twin")
    twin = Scope.for_user("concierge", "twin")
    [copied] = mem.pending(twin)
    got = mem.record(twin, FactCandidate("user", "last_turn", "HARBOUR", "t"), origin="agent", evidence=["x"])
    assert got.action == "merged" and got.fact.id == copied.id
    assert len(mem.pending(twin)) == 1


def test_current_facts_of_a_scope_in_order_and_cut_at_the_limit(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    for n in range(5):  # closed values of one attribute, then its current one
        _learn(mem, f"city {n}", origin="user", attribute="city", at=T0 + n)
    for n in range(5):  # pending values that pile up
        _learn(mem, f"guess {n}", attribute="city", at=T0 + 10 + n)
    _learn(mem, "tea", origin="user", attribute="likes", at=T0 + 2.5)
    _learn(mem, "Rex", origin="user", attribute="dog", at=T0 - 1)
    assert [f.value for f in mem.recall(BOB)] == ["Rex", "tea", "city 4"]  # oldest first by valid time
    assert [f.value for f in tenant.facts.list(BOB, limit=2)] == ["Rex", "tea"]
    assert [f.value for f in mem.recall(BOB, subject="user", attribute="city")] == ["city 4"]
    assert [f.value for f in mem.recall(BOB, attribute="city", include_pending=True)] == (
        ["city 4"] + [f"guess {n}" for n in range(5)])
    assert [f.value for f in mem.recall(BOB, attribute="city", valid_at=T0 + 2.5)] == ["city 2"]
    assert len(mem.history(BOB, "user", "city")) == 5
