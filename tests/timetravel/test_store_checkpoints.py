"""The store half of agent checkpoints on both backends: take, roll back (and forward to an abandoned branch),
copy to a new user, prune, forget — on rows written through the ordinary repositories."""

from __future__ import annotations

import time

import pytest

from moorage.errors import ConflictError, NotFound
from moorage.memory import FactCandidate, SemanticMemory
from moorage.store import Scope, Store, TenantStore
from moorage.store.model import FACT_STATUS
from moorage.store.repos.checkpoints import Checkpoints
from tests.timetravel.conftest import store_view

A, U = "bot", "u_1"  # "_" in the id: prefixes are matched exactly, never as a LIKE wildcard


def _run_id(n: int, user: str) -> str:
    return f"run{n:04d}-{user.replace('_', 'x')}"


def _turn(ts: TenantStore, n: int, user: str = U) -> None:
    """What a turn writes: a run with a step and a journal entry, an event, a fact, a state record."""
    run_id = _run_id(n, user)
    with ts.transaction():
        ts.runs.create(Scope.workflow(A, run_id, user=user), "turn", {"message": f"turn {n}"}, run_id=run_id)
        ts.runs.record_step(run_id, 0, "side", "succeeded", attempts=1, result=n * 10)
        entry, _ = ts.journal.claim(f"wf:{run_id}:0", run_id=run_id, step="side")
        ts.journal.complete(entry.key, expected_version=entry.version, result=n * 10)
        ts.events.append(Scope.session(A, user, "default"), "message", f"milestone {n} for {user}", speaker="user")
        rec = ts.state.get(Scope.for_user(A, user), "counter")
        ts.state.put(Scope.for_user(A, user), "counter", n, expected_version=rec.version if rec else 0)
    SemanticMemory(ts).record(Scope.for_user(A, user), FactCandidate("user", "last_turn", str(n), f"turn {n}"),
                              origin="user")


@pytest.fixture
def ts(store: Store) -> TenantStore:
    _, key = store.operator.create_tenant("tt")
    return store.tenant(store.authenticate(key.secret))


def test_rollback_then_forward_to_the_abandoned_branch(ts: TenantStore) -> None:
    cps = Checkpoints(ts)
    ids = {}
    views = {}
    for n in range(1, 7):
        _turn(ts, n)
        ids[n] = cps.take(A, U, turn_id=_run_id(n, U)).id
        views[n] = store_view(ts, A, U)
    other_before = None
    _turn(ts, 1, user="u1")  # a user whose id matches U's with "_" as a wildcard: never touched
    other_before = store_view(ts, A, "u1")

    tip = cps.take(A, U, kind="before-rollback").id
    cps.rollback(A, U, ids[3])
    assert store_view(ts, A, U) == views[3]
    assert [f.value for f in ts.facts.list(Scope.for_user(A, U))] == ["3"]  # current facts
    assert ts.state.get(Scope.for_user(A, U), "counter").value == 3

    _turn(ts, 40)  # the new branch
    cps.take(A, U, turn_id=_run_id(40, U))
    assert [e.content for e in ts.events.list(Scope.session(A, U, "default"))][-1] == "milestone 40 for u_1"

    cps.rollback(A, U, tip)  # back to where the first branch ended
    assert store_view(ts, A, U) == views[6]
    cps.rollback(A, U, ids[2])
    assert store_view(ts, A, U) == views[2]
    assert store_view(ts, A, "u1") == other_before

    branches = {c.branch for c in cps.list(A, U)}
    head = cps.head(A, U)
    assert len(branches) == 2 and head is not None and head.branch not in branches and head.head_id == ids[2]


def test_copy_to_a_new_user_then_both_diverge(ts: TenantStore) -> None:
    cps = Checkpoints(ts)
    for n in range(1, 4):
        _turn(ts, n)
        ck = cps.take(A, U)
    source = store_view(ts, A, U)
    cps.copy_to_user(A, U, ck.id, "twin")
    twin = store_view(ts, A, "twin")
    assert [f[1] for f in twin["facts"]] == [f[1] for f in source["facts"]]
    assert [e[1] for e in twin["events"]] == [e[1] for e in source["events"]]
    assert len(twin["runs"]) == len(source["runs"]) and not set(twin["runs"]) & set(source["runs"])
    # Provenance of the copied facts names the copied events, not the source's.
    twin_facts = ts.facts.list(Scope.for_user(A, "twin"), include_closed=True, statuses=FACT_STATUS)
    assert all(f.source == "user" for f in twin_facts)
    _turn(ts, 9, user="twin")
    assert store_view(ts, A, U) == source
    assert ts.state.get(Scope.for_user(A, "twin"), "counter").value == 9
    with pytest.raises(ConflictError):
        cps.copy_to_user(A, U, ck.id, "twin")  # that user has data now
    cps.take(A, "twin")
    # Forgetting the twin (of every agent) removes everything, copied rows and checkpoints included.
    ts.forget_user("twin")
    assert store_view(ts, A, "twin")["events"] == [] and ts.facts.list(Scope.for_user(A, "twin")) == []
    assert ts.checkpoints.list(A, "twin") == [] and ts.checkpoints.head(A, "twin") is None
    assert ts.checkpoints.list(A, U) != []  # the source's stay


def test_prune_keeps_what_it_is_told_and_what_those_need(ts: TenantStore) -> None:
    cps = Checkpoints(ts)
    taken = []
    for n in range(1, 6):
        _turn(ts, n)
        taken.append(cps.take(A, U).id)
    before = cps.storage_bytes(A, U)
    gone = cps.prune(A, U, keep=[taken[1]])
    assert {g.id for g in gone} == {taken[0], taken[2], taken[3]}  # the head stays too
    assert [c.id for c in cps.list(A, U)] == [taken[4], taken[1]]
    assert cps.storage_bytes(A, U) < before
    cps.rollback(A, U, taken[1])  # what a kept checkpoint needs survived the pruning
    assert ts.state.get(Scope.for_user(A, U), "counter").value == 2
    with pytest.raises(NotFound):
        cps.rollback(A, U, taken[0])
    assert cps.delete_user(A, U) > 0 and cps.list(A, U) == []


def test_another_tenant_sees_no_checkpoint(store: Store, ts: TenantStore) -> None:
    _turn(ts, 1)
    ck = Checkpoints(ts).take(A, U)
    _, key = store.operator.create_tenant("other")
    other = store.tenant(store.authenticate(key.secret))
    assert Checkpoints(other).list(A, U) == []
    with pytest.raises(NotFound):
        Checkpoints(other).rollback(A, U, ck.id)
    with pytest.raises(NotFound):
        Checkpoints(other).copy_to_user(A, U, ck.id, "thief")
    assert store_view(other, A, "thief")["events"] == []


def test_an_expired_scope_takes_its_instance_checkpoints_with_it(ts: TenantStore) -> None:
    _turn(ts, 1)
    ts.state.put(Scope.for_user("other", U), "counter", 1, expected_version=0)
    Checkpoints(ts).take(A, U)
    Checkpoints(ts).take("other", U)
    ts.retention.set_agent(A, 60.0)  # agent A's data lives a minute; "other" keeps its own
    _turn(ts, 2)
    report = ts.sweep(now=time.time() + 3600)
    assert report.scopes >= 1
    assert Checkpoints(ts).list(A, U) == []  # images of expired rows do not outlive them
    assert Checkpoints(ts).list("other", U) != []


def test_only_automatic_checkpoints_still_being_written_behind_their_turns_may_be_unwritten(ts: TenantStore) -> None:
    """What a restarted host checks (``TimeTravel._unwritten``): the rows marked as being written behind their turn
    until their files are on disk (``written``), not every instance's newest; and how it marks one missing."""
    cps = Checkpoints(ts)
    _turn(ts, 1)
    first = cps.take(A, U, turn_id=_run_id(1, U), sandbox_id="sb1", sandbox_checkpoint="tt-a", writing=True)
    assert [c.id for c in cps.written_behind()] == [first.id]
    cps.written(A, U, first.id)  # its files are on disk
    _turn(ts, 2)
    newest = cps.take(A, U, turn_id=_run_id(2, U), sandbox_id="sb1", sandbox_checkpoint="tt-b", writing=True)
    cps.take(A, U, kind="manual", name="mine")  # no sandbox half: not one written behind
    _turn(ts, 1, user="u1")
    cps.take(A, "u1", kind="manual", sandbox_id="sb2", sandbox_checkpoint="tt-c")  # written before its reply
    cps.take(A, "u1", sandbox_id="sb2", sandbox_checkpoint="tt-d")  # an older host's: not marked
    assert [(c.user, c.id) for c in cps.written_behind()] == [(U, newest.id)]
    assert cps.mark_unwritten(A, U, newest.id, "never written")
    assert not cps.mark_unwritten(A, U, newest.id, "again")  # a turn checkpoint no more
    got = cps.get(A, U, newest.id)
    assert got.kind == "missing" and got.summary["error"] == "never written" and "turn" in got.summary
    assert cps.written_behind() == []
    with pytest.raises(ConflictError, match="is missing"):
        cps.restorable(A, U, newest.id)
