"""The store conformance suite: every backend (SQLite, PostgreSQL) must behave identically."""

from __future__ import annotations

import math
import time

import pytest

from moorage.errors import ConflictError, InvalidInput, NotFound, TenantScopeError, Unauthenticated
from moorage.store import Principal, Scope, Store, TenantStore

S = Scope.session("bot", "alice", "s1")
U = Scope.for_user("bot", "alice")


# -- authentication and keys ------------------------------------------------------------------


def test_authenticate_maps_key_to_its_tenant(store: Store) -> None:
    t, key = store.operator.create_tenant("acme")
    p = store.authenticate(key.secret)
    assert p.tenant_id == t.id and "admin" in p.scopes


def test_bad_keys_are_rejected(store: Store, tenant: TenantStore) -> None:
    for bad in ("", "nope", "mrg_" + "x" * 43, "mrg_\x00", 42):
        with pytest.raises(Unauthenticated):
            store.authenticate(bad)  # type: ignore[arg-type]


def test_scoped_and_revoked_keys(store: Store, tenant: TenantStore) -> None:
    k = tenant.keys.create(["invoke"], "frontend")
    p = store.authenticate(k.secret)
    assert p.scopes == frozenset({"invoke"})
    with pytest.raises(TenantScopeError):
        store.tenant(p).keys.create(["admin"])
    tenant.keys.revoke(k.id)
    with pytest.raises(Unauthenticated):
        store.authenticate(k.secret)
    assert all(not k.secret for k in tenant.keys.list())  # secrets are never read back
    with pytest.raises(InvalidInput):
        tenant.keys.create(["root"])


def test_key_revocations_are_looked_up_by_id_within_the_tenant(store: Store, tenant: TenantStore) -> None:
    """What an end-user token's check and the revoked-work sweep ask: each key's revocation, by id, of this tenant
    only (another tenant's key, or none, is not in the answer), any number at once."""
    keys = [tenant.keys.create(["invoke"], f"k{i}") for i in range(3)]
    tenant.keys.revoke(keys[1].id)
    other, admin = store.operator.create_tenant("revocations-other")
    theirs = store.tenant(store.authenticate(admin.secret)).keys.create(["invoke"])
    ids = [k.id for k in keys] + [theirs.id, "no-such-key"] + [f"x{i}" for i in range(1200)]
    got = store.backend.key_revocations(tenant.tenant_id, ids)
    assert set(got) == {k.id for k in keys}
    assert got[keys[0].id] is None and got[keys[2].id] is None and isinstance(got[keys[1].id], float)
    assert store.backend.key_revocations(other.id, [keys[0].id, theirs.id]) == {theirs.id: None}
    assert store.backend.key_revocations(tenant.tenant_id, []) == {}


def test_ping_is_one_round_trip_to_the_control_plane(store: Store) -> None:
    """A readiness probe's look at the store (``GET /readyz``): it returns when the store answers (on PostgreSQL
    its outage raises StoreUnreachable: tests/outage/test_postgres_host.py)."""
    assert store.ping() is None
    store.operator.create_tenant("after-a-ping")
    assert store.ping() is None and [t.name for t in store.operator.list_tenants()] == ["after-a-ping"]


def test_control_plane_calls_from_many_threads_at_once(store: Store) -> None:
    """Hosts call the control plane from worker threads concurrently (e.g. sleeping every instance at
    shutdown): transactions on it must not interleave."""
    from concurrent.futures import ThreadPoolExecutor

    ids = [store.operator.create_tenant(f"t{i}")[0].id for i in range(4)]

    def work(i: int) -> str:
        tid = ids[i % len(ids)]
        store.operator.principal(tid)
        store.operator.create_tenant(f"made-{i}")
        return store.operator.get_tenant(tid).id

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(work, range(40))) == [ids[i % len(ids)] for i in range(40)]
    assert len(store.operator.list_tenants()) == 44


def test_unknown_tenant_principal_cannot_read(store: Store, tenant: TenantStore) -> None:
    forged = store.tenant(Principal("0" * 32))
    with pytest.raises(TenantScopeError) if store.backend.dialect == "sqlite" else _nothing():
        assert forged.state.get(S, "k") is None


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> bool:
        return False


# -- compare-and-set state --------------------------------------------------------------------


def test_state_cas_lifecycle(tenant: TenantStore) -> None:
    r1 = tenant.state.put(S, "plan", {"step": 1}, expected_version=0)
    assert r1.version == 1
    r2 = tenant.state.put(S, "plan", {"step": 2}, expected_version=1)
    assert r2.version == 2 and tenant.state.get(S, "plan").value == {"step": 2}
    with pytest.raises(ConflictError) as e:
        tenant.state.put(S, "plan", {"step": 99}, expected_version=1)
    assert e.value.current_version == 2
    with pytest.raises(ConflictError):
        tenant.state.put(S, "plan", {}, expected_version=0)
    with pytest.raises(ConflictError):
        tenant.state.put(S, "missing", {}, expected_version=3)
    assert tenant.state.get(S, "plan").value == {"step": 2}
    with pytest.raises(ConflictError):
        tenant.state.delete(S, "plan", expected_version=1)
    tenant.state.delete(S, "plan", expected_version=2)
    assert tenant.state.get(S, "plan") is None


def test_state_is_per_scope(tenant: TenantStore) -> None:
    tenant.state.put(S, "k", 1, expected_version=0)
    tenant.state.put(U, "k", 2, expected_version=0)
    other = Scope.session("bot", "alice", "s2")
    assert tenant.state.get(other, "k") is None
    assert [r.key for r in tenant.state.list(S)] == ["k"]


@pytest.mark.parametrize(
    "value",
    ["x" * (70 * 1024), math.nan, {"f": object()}],
    ids=["oversized", "nan", "not-json"],
)
def test_bad_values_change_nothing(tenant: TenantStore, value: object) -> None:
    tenant.state.put(S, "k", "kept", expected_version=0)
    with pytest.raises(InvalidInput):
        tenant.state.put(S, "k", value, expected_version=1)
    r = tenant.state.get(S, "k")
    assert r.value == "kept" and r.version == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: Scope("global", "bot", "alice"),  # type: ignore[arg-type]
        lambda: Scope.session("bot", "alice", "../etc"),
        lambda: Scope.session("bot", "", "s1"),
        lambda: Scope.for_user("b ot", "alice"),
        lambda: Scope("user", "bot"),
    ],
    ids=["unknown-kind", "traversal", "empty-user", "space", "user-without-user"],
)
def test_malformed_scopes_are_typed_errors(make: object) -> None:
    with pytest.raises(InvalidInput):
        make()  # type: ignore[operator]


def test_malformed_keys_and_versions(tenant: TenantStore) -> None:
    for key in ("", "k" * 300, "a\x00b", 5):
        with pytest.raises(InvalidInput):
            tenant.state.put(S, key, 1, expected_version=0)  # type: ignore[arg-type]
    for v in (-1, "1", True, 1.5):
        with pytest.raises(InvalidInput):
            tenant.state.put(S, "k", 1, expected_version=v)  # type: ignore[arg-type]
    assert tenant.state.list(S) == []


def test_transaction_is_atomic(tenant: TenantStore) -> None:
    tenant.state.put(S, "a", 10, expected_version=0)
    with pytest.raises(RuntimeError):
        with tenant.transaction():
            tenant.state.put(S, "a", 9, expected_version=1)
            tenant.state.put(S, "b", 1, expected_version=0)
            tenant.events.append(S, "transfer", "moved one")
            raise RuntimeError("crash mid-way")
    assert tenant.state.get(S, "a").value == 10
    assert tenant.state.get(S, "b") is None
    assert tenant.events.list(S) == []


def test_conflict_inside_transaction_rolls_back_everything(tenant: TenantStore) -> None:
    tenant.state.put(S, "a", 1, expected_version=0)
    with pytest.raises(ConflictError):
        with tenant.transaction():
            tenant.state.put(S, "b", 1, expected_version=0)
            tenant.state.put(S, "a", 2, expected_version=7)
    assert tenant.state.get(S, "b") is None


# -- agents, deployments, users, sessions -----------------------------------------------------


def test_agents_and_deployments(tenant: TenantStore) -> None:
    a = tenant.agents.create("helper", {"model": "local"})
    with pytest.raises(ConflictError):
        tenant.agents.create("helper")
    d1 = tenant.deployments.create(a.id, {"entry": "agent.py"}, "pkg/1", "ab" * 32)
    d2 = tenant.deployments.create(a.id, {"entry": "agent.py"}, "pkg/2", "cd" * 32)
    assert (d1.number, d2.number) == (1, 2)
    a2 = tenant.agents.update(a.id, expected_version=1, live_deployment=d2.id)
    assert a2.live_deployment == d2.id and tenant.agents.get("helper").version == 2
    with pytest.raises(ConflictError):
        tenant.agents.update(a.id, expected_version=1, live_deployment=d1.id)
    with pytest.raises(NotFound):
        tenant.agents.update(a.id, expected_version=2, live_deployment="nope")
    assert [d.number for d in tenant.deployments.list(a.id)] == [1, 2]
    with pytest.raises(NotFound):
        tenant.agents.get("ghost")


def test_sessions_create_users(tenant: TenantStore) -> None:
    s1 = tenant.sessions.open("bot", "alice", "s1")
    s1b = tenant.sessions.open("bot", "alice", "s1")
    assert s1.id == s1b.id and s1b.last_active >= s1.last_active
    tenant.sessions.open("bot", "alice")
    assert len(tenant.sessions.list("bot", "alice")) == 2
    assert tenant.users.get("alice").id == "alice"


# -- episodic events --------------------------------------------------------------------------


def test_events_are_time_ordered_and_filtered(tenant: TenantStore) -> None:
    t0 = 1_700_000_000.0
    tenant.events.append(S, "message", "hello there", speaker="alice", ts=t0 + 2)
    tenant.events.append(S, "message", "hi alice", speaker="bot", ts=t0 + 1)
    tenant.events.append(S, "tool", "weather: sunny", speaker="tool", ts=t0 + 3)
    assert [e.content for e in tenant.events.list(S)] == ["hi alice", "hello there", "weather: sunny"]
    assert [e.speaker for e in tenant.events.list(S, speakers=["alice"])] == ["alice"]
    assert [e.kind for e in tenant.events.list(S, since=t0 + 2.5)] == ["tool"]
    assert tenant.events.count(S) == 3


def test_event_full_text_search(tenant: TenantStore) -> None:
    tenant.events.append(S, "message", "My sister lives in Lisbon and loves surfing", speaker="alice")
    tenant.events.append(S, "message", "I bought a new laptop yesterday", speaker="alice")
    hits = tenant.events.search_text(S, "where does the sister live?")
    assert hits and "Lisbon" in hits[0][0].content
    assert tenant.events.search_text(S, "!!!") == []
    assert tenant.events.search_text(Scope.session("bot", "bob", "s1"), "sister") == []


def test_embeddings_roundtrip(tenant: TenantStore) -> None:
    e = tenant.events.append(S, "message", "x")
    tenant.events.put_embeddings(S, [(e.id, b"\x00\x01" * 8)])
    assert tenant.events.embeddings(S) == [(e.id, b"\x00\x01" * 8)]


# -- semantic facts: bi-temporal ---------------------------------------------------------------


def test_facts_bitemporal(tenant: TenantStore) -> None:
    old = tenant.facts.insert(U, "alice", "city", "Paris", "Alice lives in Paris", valid_from=100.0, provenance=["1"])
    new = tenant.facts.insert(U, "alice", "city", "Berlin", "Alice moved to Berlin", valid_from=200.0)
    tenant.facts.close(old.id, expected_version=1, valid_to=200.0, superseded_by=new.id)
    with pytest.raises(ConflictError):
        tenant.facts.close(old.id, expected_version=1, valid_to=300.0)
    assert [f.value for f in tenant.facts.list(U, subject="alice", attribute="city")] == ["Berlin"]
    assert [f.value for f in tenant.facts.list(U, attribute="city", valid_at=150.0)] == ["Paris"]
    assert len(tenant.facts.list(U, include_closed=True)) == 2
    closed = tenant.facts.get(old.id)
    assert closed.superseded_by == new.id and closed.valid_to == 200.0 and closed.provenance == ("1",)
    with pytest.raises(InvalidInput):
        tenant.facts.insert(U, "a", "b", "c", "d", trust="gospel")


# -- workflows, steps, journal ----------------------------------------------------------------


def test_workflow_runs_and_steps(tenant: TenantStore) -> None:
    W = Scope.workflow("bot", "run1", user="alice")
    run = tenant.runs.create(W, "book_trip", {"to": "Oslo"})
    assert run.id == "run1"
    r2 = tenant.runs.update(run.id, expected_version=1, status="running", state={"i": 1}, current_step="search")
    with pytest.raises(ConflictError):
        tenant.runs.update(run.id, expected_version=1, status="failed")
    tenant.runs.record_step(run.id, 1, "search", "succeeded", result={"hits": 3}, finished_at=time.time())
    tenant.runs.record_step(run.id, 2, "book", "failed", error="card declined", attempts=2)
    assert [(s.name, s.status) for s in tenant.runs.steps(run.id)] == [("search", "succeeded"), ("book", "failed")]
    assert tenant.runs.get(run.id).state == {"i": 1} and r2.version == 2
    assert [r.id for r in tenant.runs.list(status=["running"])] == ["run1"]
    with pytest.raises(InvalidInput):
        tenant.runs.update(run.id, expected_version=2, status="exploded")


def test_workflow_runs_of_one_user(tenant: TenantStore) -> None:
    """``runs.list(agent=, user=)``: that end-user's runs of that agent, in every kind of scope, and no one else's (a
    user whose id starts with theirs, another agent's user of the same id)."""
    for scope, run_id in [(Scope.workflow("bot", "t1", user="ada"), "t1"), (Scope.for_user("bot", "ada"), "u1"),
                          (Scope("session", "bot", "ada", "s1"), "s1"), (Scope.workflow("bot", "t2", user="ada-2"), "t2"),
                          (Scope.for_user("bot", "ada-2"), "u2"), (Scope.workflow("other", "t3", user="ada"), "t3"),
                          (Scope.workflow("bot", "t4"), "t4")]:
        tenant.runs.create(scope, "turn", run_id=run_id)
    assert sorted(r.id for r in tenant.runs.list(agent="bot", user="ada")) == ["s1", "t1", "u1"]
    assert sorted(r.id for r in tenant.runs.list(agent="bot", user="ada-2")) == ["t2", "u2"]
    assert sorted(r.id for r in tenant.runs.list(agent="bot")) == ["s1", "t1", "t2", "t4", "u1", "u2"]
    with pytest.raises(ValueError):
        tenant.runs.list(user="ada")


def test_executions_record_the_key_that_started_them(tenant: TenantStore, other_tenant: TenantStore) -> None:
    """Each execution keeps the API key that started it (store migration 30): ``keys_of`` reads it, and
    ``queued_of_key`` finds that key's async turns without a run and not announced, in one tenant."""
    ex, created = tenant.executions.create("q1", "bot", "alice", "default", {"message": "a"}, "key-k")
    assert created and ex.key_id == "key-k" and tenant.executions.get("q1").key_id == "key-k"
    assert tenant.executions.create("q1", "bot", "alice", "default", {"message": "a"}, "key-o")[0].key_id == "key-k"
    tenant.executions.create("q2", "bot", "bob", "s", {"message": "b"}, "key-k")
    tenant.executions.create("started", "bot", "alice", "default", {"message": "c"}, "key-k")
    tenant.runs.create(Scope.workflow("bot", "started", user="alice"), "turn", run_id="started")
    done, _ = tenant.executions.create("done", "bot", "alice", "default", {"message": "d"}, "key-k")
    assert tenant.executions.mark_announced("done", "failed", expected_version=done.version)
    tenant.executions.create("other-key", "bot", "alice", "default", {"message": "e"}, "key-o")
    tenant.executions.create("operator", "bot", "alice", "default", {"message": "f"})
    other_tenant.executions.create("theirs", "bot", "alice", "default", {"message": "g"}, "key-k")
    assert [e.id for e in tenant.executions.queued_of_key("key-k")] == ["q1", "q2"]  # in the order of their ids
    assert [e.id for e in tenant.executions.queued_of_key("key-k", limit=1)] == ["q1"]
    assert [e.id for e in tenant.executions.queued_of_key("key-k", after="q1", limit=1)] == ["q2"]
    assert tenant.executions.queued_of_key("key-k", after="q2") == []
    assert [e.id for e in tenant.executions.queued_of_key("key-o")] == ["other-key"]
    assert tenant.executions.queued_of_key("key-none") == []
    assert tenant.executions.keys_of(["q1", "other-key", "operator", "theirs", "nothing"]) == {
        "q1": "key-k", "other-key": "key-o", "operator": None}
    assert tenant.executions.keys_of(["q2", "x", "q2"]) == {"q2": "key-k"}
    assert [e.id for e in other_tenant.executions.queued_of_key("key-k")] == ["theirs"]


def test_journal_claims_once(tenant: TenantStore) -> None:
    e, created = tenant.journal.claim("pay-42", run_id="r", step="pay")
    assert created and e.status == "pending"
    again, created2 = tenant.journal.claim("pay-42")
    assert not created2 and again.status == "pending"
    done = tenant.journal.complete("pay-42", expected_version=1, result={"receipt": "x1"})
    assert done.status == "done" and done.result == {"receipt": "x1"}
    with pytest.raises(ConflictError):
        tenant.journal.complete("pay-42", expected_version=2, result={"receipt": "x2"})
    assert tenant.journal.get("pay-42").result == {"receipt": "x1"}


# -- sandboxes, spans, usage ------------------------------------------------------------------


def test_sandbox_records_cas(tenant: TenantStore) -> None:
    rec = tenant.sandboxes.create(U, state="provisioning", host="h1")
    with pytest.raises(ConflictError):
        tenant.sandboxes.create(U, state="provisioning")
    r2 = tenant.sandboxes.update(rec.id, expected_version=1, state="running")
    with pytest.raises(ConflictError):
        tenant.sandboxes.update(rec.id, expected_version=1, state="sleeping")
    r3 = tenant.sandboxes.update(rec.id, expected_version=2, state="sleeping", snapshot_ref="snap/1", host=None)
    assert (r2.state, r3.state, r3.snapshot_ref, r3.host) == ("running", "sleeping", "snap/1", None)
    assert tenant.sandboxes.for_scope(U).version == 3
    assert [s.id for s in tenant.sandboxes.list(states=["sleeping"])] == [rec.id]


def test_spans_and_usage(tenant: TenantStore) -> None:
    from moorage.store import Span

    tenant.spans.record(Span("t1", "a", None, "turn", 1.0, 2.0, "ok", {"user": "alice"}, S))
    tenant.spans.record(Span("t1", "b", "a", "llm", 1.1, 1.9, "ok", {"tokens": 12}, S))
    assert [s.name for s in tenant.spans.trace("t1")] == ["turn", "llm"]
    tenant.usage.add("input_tokens", 100, agent_id="bot", user_id="alice")
    tenant.usage.add("input_tokens", 50, agent_id="bot", user_id="bob")
    assert tenant.usage.totals()["input_tokens"] == 150
    assert tenant.usage.totals(user_id="bob")["input_tokens"] == 50
    with pytest.raises(InvalidInput):
        tenant.usage.add("bitcoins", 1)


# -- retention, forgetting, isolation ---------------------------------------------------------


def test_ttl_sweeper_deletes_only_expired_scopes(tenant: TenantStore) -> None:
    tenant.retention.set("session", 60)
    tenant.state.put(S, "k", 1, expected_version=0)
    tenant.events.append(S, "message", "ephemeral chat")
    tenant.state.put(U, "pref", "tea", expected_version=0)  # user scope: no TTL
    assert tenant.sweep(now=time.time() + 30).scopes == 0
    rep = tenant.sweep(now=time.time() + 120)
    assert rep.scopes == 1 and rep.rows >= 2
    assert tenant.state.get(S, "k") is None and tenant.events.list(S) == []
    assert tenant.state.get(U, "pref").value == "tea"
    with pytest.raises(InvalidInput):
        tenant.retention.set("session", -5)


def test_forget_user_removes_everything(tenant: TenantStore) -> None:
    W = Scope.workflow("bot", "wf1", user="alice")
    tenant.sessions.open("bot", "alice", "s1")
    tenant.state.put(S, "k", "secret-alice", expected_version=0)
    tenant.events.append(U, "message", "secret-alice")
    tenant.facts.insert(U, "alice", "pet", "cat", "secret-alice")
    tenant.runs.create(W, "wf")
    tenant.journal.claim("j1", run_id="wf1", scope=W)
    tenant.usage.add("input_tokens", 5, agent_id="bot", user_id="alice")
    tenant.state.put(Scope.for_user("bot", "bob"), "k", "bob-stays", expected_version=0)
    assert tenant.forget_user("alice") > 0
    assert tenant.state.get(S, "k") is None
    assert tenant.events.list(U) == [] and tenant.facts.list(U, include_closed=True) == []
    with pytest.raises(NotFound):
        tenant.runs.get("wf1")
    assert tenant.journal.get("j1") is None
    assert tenant.sessions.list("bot", "alice") == []
    assert tenant.state.get(Scope.for_user("bot", "bob"), "k").value == "bob-stays"


def test_tenants_cannot_see_each_other(tenant: TenantStore, other_tenant: TenantStore) -> None:
    tenant.state.put(S, "k", "acme-secret", expected_version=0)
    tenant.events.append(S, "message", "acme confidential roadmap")
    tenant.agents.create("bot")
    run = tenant.runs.create(Scope.workflow("bot", "r1"), "wf")
    assert other_tenant.state.get(S, "k") is None
    assert other_tenant.events.list(S) == []
    assert other_tenant.events.search_text(S, "confidential roadmap") == []
    assert other_tenant.agents.list() == []
    with pytest.raises(NotFound):
        other_tenant.runs.get(run.id)
    # The same key in the other tenant is a different record, not a conflict.
    assert other_tenant.state.put(S, "k", "globex", expected_version=0).version == 1
    assert tenant.state.get(S, "k").value == "acme-secret"
