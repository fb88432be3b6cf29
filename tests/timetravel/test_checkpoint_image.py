"""Incremental checkpoints (migration 16, ``checkpoint_image``): a checkpoint reads only the rows written since the
one before and stores a delta on it, so each stored manifest, resolved from the database, must equal the
instance's rows read whole at that point — after updates, deletes, rollbacks, pruning and (PostgreSQL) a writer
that commits after the checkpoint's snapshot. Both backends."""

from __future__ import annotations

import random
import threading
import time

import pytest

from moorage.store import Scope, Store, TenantStore
from moorage.store.postgres import PostgresBackend
from moorage.store.repos import checkpoint_image as ci
from moorage.store.repos.checkpoints import Checkpoints
from moorage.store.sql import Conn
from tests.timetravel.test_store_checkpoints import A, U, _run_id, _turn


@pytest.fixture
def ts(store: Store) -> TenantStore:
    _, key = store.operator.create_tenant("img")
    return store.tenant(store.authenticate(key.secret))


def _whole(ts: TenantStore, user: str = U) -> dict[str, dict[str, str]]:
    with ts.transaction():
        return ci.read(ts.ambient(), A, user).manifest.rows  # type: ignore[arg-type]


def _stored(ts: TenantStore, checkpoint_id: str) -> dict[str, dict[str, str]]:
    """The checkpoint's manifest as the database holds it (the in-process cache emptied first)."""
    ci.CACHE._d.clear()
    with ts.transaction():
        return ci.resolve(ts.ambient(), ts.tenant_id, checkpoint_id).rows  # type: ignore[arg-type]


def _kinds(ts: TenantStore, user: str = U) -> list[str]:
    with ts.transaction():
        rows = ts.ambient().q("SELECT manifest FROM checkpoints WHERE agent_id = ? AND user_id = ? ORDER BY seq",  # type: ignore[union-attr]
                              (A, user))
    return ["whole" if ci.base_of(r[0]) is None else "delta" for r in rows]


def _write_something(ts: TenantStore, rnd: random.Random, n: int, user: str) -> None:
    """One of the writes agent turns and the API make to an instance's rows, updates and deletes included."""
    scope = Scope.for_user(A, user)
    op = rnd.choice(["turn", "put", "delete", "claim-release", "step-again", "run-update", "session"])
    if op == "turn":
        _turn(ts, n, user)
    elif op == "put":
        key = f"k{rnd.randrange(4)}"
        rec = ts.state.get(scope, key)
        ts.state.put(scope, key, rnd.randrange(3), expected_version=rec.version if rec else 0)
    elif op == "delete":
        recs = ts.state.list(scope)
        if recs:
            r = rnd.choice(recs)
            ts.state.delete(scope, r.key, expected_version=r.version)
    elif op == "claim-release":
        entry, _ = ts.journal.claim(f"ext:{user}:{n}", scope=scope, step="pay")
        if rnd.random() < 0.5:
            ts.journal.release(entry.key, expected_version=entry.version)
    else:
        runs = [r for r in ts.runs.list(limit=10_000) if r.scope.user == user and r.scope.agent == A]
        if op == "session":
            ts.sessions.open(A, user, f"s{rnd.randrange(3)}")
        elif runs and op == "step-again":
            # Same key deleted and written again in one transaction: same body or a new one.
            ts.runs.record_step(rnd.choice(runs).id, 0, "side", rnd.choice(["succeeded", "failed"]), attempts=1)
        elif runs:
            run = rnd.choice(runs)
            ts.runs.update(run.id, expected_version=run.version, state={"seen": rnd.randrange(3)})


@pytest.mark.parametrize("seed", [1, 2])
def test_every_stored_manifest_equals_the_rows_read_whole(ts: TenantStore, seed: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ci, "FULL_EVERY", 4)  # whole manifests and chains of deltas both, in a short run
    rnd = random.Random(seed)
    cps = Checkpoints(ts)
    taken: dict[str, dict[str, dict[str, str]]] = {}
    kinds: set[str] = set()
    writes = iter(range(1, 10_000))  # each write's own number (run ids, journal keys)
    for n in range(1, 61):
        for _ in range(rnd.randrange(3)):
            _write_something(ts, rnd, next(writes), U)
        # Another user whose id matches U's with "_" read as a wildcard, and a prefix of it: never imaged.
        _write_something(ts, rnd, next(writes), rnd.choice(["u1", "u"]))
        roll = rnd.random()
        if roll < 0.6:
            ck = cps.take(A, U)
            taken[ck.id] = _whole(ts)
            assert _stored(ts, ck.id) == taken[ck.id], f"step {n}"
            kinds.add(_kinds(ts)[-1])
        elif roll < 0.75 and taken:
            back = rnd.choice(list(taken))
            cps.rollback(A, U, back)
            assert _whole(ts) == taken[back], f"step {n}"
        elif roll < 0.85 and len(taken) > 3:
            keep = rnd.sample(list(taken), len(taken) // 2)
            for g in cps.prune(A, U, keep):
                taken.pop(g.id)
    assert kinds == {"whole", "delta"}
    for cid, rows in taken.items():  # every kept checkpoint still resolves to what it held, chains repaired
        assert _stored(ts, cid) == rows


def test_a_checkpoint_reads_only_rows_written_since_the_one_before(ts: TenantStore) -> None:
    cps = Checkpoints(ts)
    for n in range(1, 21):
        _turn(ts, n)
        cps.take(A, U, turn_id=_run_id(n, U))
    with ts.transaction():
        c = ts.ambient()
        head = cps._head(c, A, U)  # type: ignore[arg-type]
        assert head is not None and head.head_id is not None
        base = ci.resolve(c, ts.tenant_id, head.head_id)  # type: ignore[arg-type]
        img = ci.read(c, A, U, base, head.row_mark)  # type: ignore[arg-type]
    assert img.changed == {} and img.bodies == {}  # nothing written since: no body read
    _turn(ts, 21)
    with ts.transaction():
        img = ci.read(ts.ambient(), A, U, base, head.row_mark)  # type: ignore[arg-type]
    # Turn 21's run, step, journal entry and fact, the state record it updated and the fact it closed.
    assert sorted(img.changed) == ["facts", "journal", "state", "steps", "workflow_runs"]
    assert sum(len(v) for v in img.changed.values()) <= 7
    assert img.manifest.rows == _whole(ts)


def test_a_turn_summary_names_the_turns_message_and_steps(ts: TenantStore) -> None:
    _turn(ts, 1)
    ck = Checkpoints(ts).take(A, U, turn_id=_run_id(1, U))
    assert ck.summary["turn"]["message"] == "turn 1"
    assert ck.summary["turn"]["steps"] == [{"name": "side", "status": "succeeded"}]


def test_a_writer_that_commits_after_the_checkpoints_snapshot_is_in_the_next_checkpoint(pg_url: str) -> None:
    """PostgreSQL only: SQLite has one writer per database, so no write can be in flight during a checkpoint."""
    store = Store(PostgresBackend(pg_url), max_value_bytes=64 * 1024)
    try:
        _, key = store.operator.create_tenant("late")
        ts = store.tenant(store.authenticate(key.secret))
        cps = Checkpoints(ts)
        _turn(ts, 1)
        cps.take(A, U)
        wrote, release, done = threading.Event(), threading.Event(), threading.Event()

        def late_writer() -> None:
            with ts.transaction():
                ts.state.put(Scope.for_user(A, U), "late", "in flight", expected_version=0)
                wrote.set()
                release.wait(10)
            done.set()

        t = threading.Thread(target=late_writer)
        t.start()
        assert wrote.wait(10)
        during = cps.take(A, U)  # the writer's transaction is open: its row is not in this checkpoint
        release.set()
        assert done.wait(10)
        t.join()
        assert "late" not in str(_stored(ts, during.id)["state"])
        after = cps.take(A, U)
        assert _stored(ts, after.id) == _whole(ts) and "late" in str(_whole(ts)["state"])
    finally:
        store.close()


def test_checkpoints_written_before_migration_16_still_resolve_and_the_next_one_reads_whole(ts: TenantStore) -> None:
    import json
    import zlib

    cps = Checkpoints(ts)
    _turn(ts, 1)
    old = cps.take(A, U)
    before = _whole(ts)
    with ts.transaction():
        c = ts.ambient()
        # What a checkpoint looked like before: the table map itself, and a head with no mark.
        blob = zlib.compress(json.dumps(before, separators=(",", ":"), sort_keys=True).encode())
        c.x("UPDATE checkpoints SET manifest = ? WHERE id = ?", (c.blob(blob), old.id))  # type: ignore[union-attr]
        c.x("UPDATE checkpoint_heads SET row_mark = NULL")  # type: ignore[union-attr]
    ci.CACHE._d.clear()
    _turn(ts, 2)
    new = cps.take(A, U)
    assert _kinds(ts) == ["whole", "whole"] and _stored(ts, new.id) == _whole(ts)
    cps.rollback(A, U, old.id)
    assert _whole(ts) == before


def test_a_checkpoints_reads_follow_what_changed_not_the_instances_history(ts: TenantStore,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Every turn adds a run (with its step and journal entry) to the instance for good: a read that scanned the
    # instance's keys to see deletions grew by a few ms per thousand turns, on every turn (migration 18).
    cps = Checkpoints(ts)
    for n in range(1, 201):
        _turn(ts, n)
    cps.take(A, U)  # the first reads the instance whole
    _turn(ts, 201)
    fetched: list[tuple[str, int]] = []
    real_q = Conn.q

    def counting(self: Conn, sql: str, params=()):  # type: ignore[no-untyped-def]
        out = real_q(self, sql, params)
        fetched.append((sql.split(" FROM ")[1].split()[0] if " FROM " in sql else sql[:20], len(out)))
        return out

    monkeypatch.setattr(Conn, "q", counting)
    ck = cps.take(A, U)
    monkeypatch.undo()
    assert sum(n for _, n in fetched) < 20, fetched  # turn 201's rows, not 200 turns' keys
    assert _stored(ts, ck.id) == _whole(ts)


def test_deletions_are_kept_for_recent_heads_and_an_older_head_reads_whole(ts: TenantStore) -> None:
    cps = Checkpoints(ts)
    scope = Scope.for_user(A, U)
    for user in (U, "v"):
        _turn(ts, 1, user)
        cps.take(A, user)
    ts.state.delete(scope, "counter", expected_version=ts.state.get(scope, "counter").version)  # type: ignore[union-attr]

    def deletions() -> int:
        with ts.transaction():
            return ts.ambient().one("SELECT COUNT(*) FROM row_deletions")[0]  # type: ignore[index,union-attr]

    with ts.transaction():
        ci.prune_deletions(ts.ambient(), time.time())  # type: ignore[arg-type]
    assert deletions() == 1  # U's head was taken before the delete: it needs it
    ck = cps.take(A, U)
    assert _kinds(ts)[-1] == "delta" and _stored(ts, ck.id) == _whole(ts)
    assert not any("counter" in k for k in _whole(ts)["state"])

    _turn(ts, 2)
    rec = ts.state.get(scope, "counter")
    ts.state.delete(scope, "counter", expected_version=rec.version)  # type: ignore[union-attr]
    cps.take(A, "v")  # writes go on after the delete (on SQLite: the clock moves past it)
    with ts.transaction():  # a week on, no head is recent: every deletion goes, and the floor rises
        assert ci.prune_deletions(ts.ambient(), time.time() + ci.DELETIONS_KEPT_S + 60) >= 1  # type: ignore[arg-type]
    assert deletions() == 0
    ck = cps.take(A, U)
    assert _kinds(ts)[-1] == "whole" and _stored(ts, ck.id) == _whole(ts)  # below the floor: read whole
    assert not any("counter" in k for k in _whole(ts)["state"])


def test_deletions_are_logged_only_for_instances_with_a_checkpoint_and_forget_removes_them(ts: TenantStore) -> None:
    def logged() -> list[str]:
        with ts.transaction():
            return sorted(r[0] for r in ts.ambient().q("SELECT owner FROM row_deletions"))  # type: ignore[union-attr]

    scope = Scope.for_user(A, "nocheck")
    ts.state.put(scope, "secret-key", 1, expected_version=0)
    ts.state.delete(scope, "secret-key", expected_version=1)
    assert logged() == []  # no checkpoint of that instance: nothing reads its deletions, nothing is kept
    cps = Checkpoints(ts)
    _turn(ts, 1)
    cps.take(A, U)
    rec = ts.state.get(Scope.for_user(A, U), "counter")
    ts.state.delete(Scope.for_user(A, U), "counter", expected_version=rec.version)  # type: ignore[union-attr]
    assert logged() == [f"{A}/{U}"]
    ts.forget_user(U)
    assert logged() == []  # the user's keys do not outlive them


def test_a_deleted_step_with_its_integer_key_leaves_the_next_manifest(ts: TenantStore) -> None:
    # A deletion records every key column as text; a step's key is (run id, integer seq).
    cps = Checkpoints(ts)
    _turn(ts, 1)
    cps.take(A, U)
    with ts.transaction():
        assert ts.ambient().x("DELETE FROM steps WHERE run_id = ? AND seq = 0", (_run_id(1, U),)) == 1  # type: ignore[union-attr]
    ck = cps.take(A, U)
    assert _kinds(ts)[-1] == "delta" and _stored(ts, ck.id) == _whole(ts)
    assert _whole(ts)["steps"] == {}
