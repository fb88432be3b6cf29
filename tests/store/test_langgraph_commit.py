"""Group commit under MoorageSaver: queued writers share one transaction, and a bad write fails alone.

Uses real stores on both backends; the batch is formed deterministically by holding the commit slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Iterator

import pytest

from moorage.store import TenantStore
from moorage.store.langgraph import MoorageSaver
from moorage.store.langgraph_commit import GroupCommit
from langgraph.checkpoint.base import empty_checkpoint

_INSERT = "INSERT INTO lg_blobs (thread_id, checkpoint_ns, channel, version, type, blob) VALUES (?, ?, ?, ?, ?, ?)"


def _queued_batch(gc: GroupCommit, ops_by_writer: list, results: dict) -> None:
    """Start one thread per writer while a commit is "in flight", then let them all go at once."""
    with gc._mu:
        gc._max_inflight = 1  # one commit "in flight": the queued writers wait for its slot
        gc._inflight = 1

    def writer(i: int, ops) -> None:
        try:
            gc.write(ops)
            results[i] = "ok"
        except Exception as e:
            results[i] = e

    # Daemon threads and deadlines: a regression in the commit hand-over fails the test instead of hanging pytest.
    threads = [threading.Thread(target=writer, args=(i, ops), daemon=True) for i, ops in enumerate(ops_by_writer)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:
        with gc._mu:
            if len(gc._queue) == len(threads):
                # Hand the held slot over, as a finishing leader does: a committer thread commits them all.
                nxt = gc._pass_slot()
                break
        assert time.monotonic() < deadline, f"only {len(gc._queue)} of {len(threads)} writers queued"
        time.sleep(0.005)
    assert nxt is not None
    assert nxt.resume()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a writer never returned"


class _NoThreads(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


@contextlib.contextmanager
def _no_new_threads() -> Iterator[None]:
    """Within: starting a thread fails as it does in a process out of threads."""
    real = threading.Thread
    threading.Thread = _NoThreads  # type: ignore[misc]
    try:
        yield
    finally:
        threading.Thread = real  # type: ignore[misc]


def test_queued_writers_commit_together_and_a_bad_one_fails_alone(tenant: TenantStore) -> None:
    gc = GroupCommit(tenant, max_inflight=1)
    good = [[(_INSERT, [("t", "", f"ch{i}", "1", "bytes", b"x")])] for i in range(6)]
    bad = [(_INSERT, [("t", "", "ch0", "1", "bytes", b"dup")]), ("INSERT INTO no_such_table VALUES (?)", [(1,)])]
    results: dict = {}
    _queued_batch(gc, [*good, bad], results)
    assert [results[i] for i in range(6)] == ["ok"] * 6
    assert isinstance(results[6], Exception)
    with tenant._tx(write=False) as c:
        rows = c.q("SELECT channel, blob FROM lg_blobs WHERE thread_id = 't' ORDER BY channel")
    # The failed writer left nothing behind (its duplicate of ch0 was rolled back with it).
    assert [(ch, bytes(b)) for ch, b in rows] == [(f"ch{i}", b"x") for i in range(6)]


def test_a_committer_thread_takes_queued_batches_and_a_lone_writer_commits_itself(
        tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone writer commits on its own thread; a finishing leader with writers queued behind it hands the
    slot to a committer thread, which commits them, parks, is reused by the next burst and exits when idle."""
    from moorage.store import langgraph_commit

    monkeypatch.setattr(langgraph_commit, "_COMMITTER_IDLE_S", 0.5)
    gc = GroupCommit(tenant, max_inflight=1)
    backend = tenant._backend
    real_tx = backend.tenant_tx
    committed_by: list[str] = []

    def recording_tx(tenant_id: str, *, write: bool = True, **kw):
        if write:
            committed_by.append(threading.current_thread().name)
        return real_tx(tenant_id, write=write, **kw)

    monkeypatch.setattr(backend, "tenant_tx", recording_tx)
    gc.write([(_INSERT, [("c", "", "lone", "1", "bytes", b"x")])])
    assert committed_by == [threading.current_thread().name]

    def burst(tag: str) -> langgraph_commit._Committer:
        results: dict = {}
        committed_by.clear()
        _queued_batch(gc, [[(_INSERT, [("c", "", f"{tag}{i}", "1", "bytes", b"x")])] for i in range(5)], results)
        assert results == {i: "ok" for i in range(5)}
        assert committed_by == ["moorage-group-commit"]  # all five in one transaction, on the committer
        deadline = time.monotonic() + 10
        while not gc._parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(gc._parked) == 1 and gc._inflight == 0  # parked, its slot given back
        return gc._parked[0]

    first = burst("a")
    assert burst("b") is first  # a parked committer is reused
    thread = first._thread
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive() and not gc._parked  # it exited after idling
    burst("c")  # and a new one serves the next burst
    committed_by.clear()
    gc.write([(_INSERT, [("c", "", "lone2", "1", "bytes", b"x")])])
    assert committed_by == [threading.current_thread().name]
    with tenant._tx(write=False) as c:
        assert c.one("SELECT count(*) FROM lg_blobs WHERE thread_id = 'c'")[0] == 17


def test_a_committer_that_cannot_start_a_thread_commits_on_the_callers(tenant: TenantStore) -> None:
    """Out of threads, the slot's queue is committed by the thread that handed the slot over, not stranded."""
    gc = GroupCommit(tenant, max_inflight=1)
    with gc._mu:
        gc._inflight = 1  # a commit "in flight": writers queue behind it
    results: dict = {}

    def writer(i: int) -> None:
        gc.write([(_INSERT, [("nothread", "", f"w{i}", "1", "bytes", b"x")])])
        results[i] = "ok"

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(gc._queue) < 3:
        assert time.monotonic() < deadline, "writers never queued"
        time.sleep(0.005)
    with _no_new_threads():
        with gc._mu:
            nxt = gc._pass_slot()
        assert nxt is not None
        assert nxt.resume() is False  # no thread: the handing thread drains the queue, as _lead does
        nxt.drain()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: "ok", 1: "ok", 2: "ok"}
    assert gc._inflight == 0 and not gc._queue and not gc._parked
    with tenant._tx(write=False) as c:
        assert c.one("SELECT count(*) FROM lg_blobs WHERE thread_id = 'nothread'")[0] == 3


def _count_commits(backend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count write transactions where every path opens them: the backend's ``tenant_tx`` (the saver may
    bypass TenantStore._tx, e.g. for pipelined transactions on PostgreSQL) and ``tenant_call`` (a batch as
    one autocommitted statement). Returns a one-element list holding the count."""
    commits = [0]
    real_tx, real_call = backend.tenant_tx, backend.tenant_call

    def counting_tx(tenant_id: str, *, write: bool = True, **kw):
        commits[0] += bool(write)
        return real_tx(tenant_id, write=write, **kw)

    def counting_call(tenant_id: str, sql: str, params=()):
        commits[0] += 1
        return real_call(tenant_id, sql, params)

    monkeypatch.setattr(backend, "tenant_tx", counting_tx)
    monkeypatch.setattr(backend, "tenant_call", counting_call)
    return commits


def _step(step: int) -> dict:
    cp = empty_checkpoint()
    cp["channel_values"] = {"step": step}
    cp["channel_versions"] = {"step": step + 1}
    return cp


def test_concurrent_puts_share_transactions_and_all_survive(tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    saver = MoorageSaver(tenant)
    commits = _count_commits(tenant._backend, monkeypatch)
    n_threads, per = 8, 15

    def run(i: int) -> None:
        config = {"configurable": {"thread_id": f"g{i}", "checkpoint_ns": ""}}
        for step in range(per):
            config = saver.put(config, _step(step), {"step": step}, {"step": step + 1})

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a writer never returned"
    monkeypatch.undo()
    for i in range(n_threads):
        listed = list(saver.list({"configurable": {"thread_id": f"g{i}"}}))
        assert [t.metadata["step"] for t in listed] == list(reversed(range(per)))
        assert listed[0].checkpoint["channel_values"] == {"step": per - 1}
    # Every put was acknowledged after a commit, and at least some commits carried several puts.
    assert 0 < commits[0] <= n_threads * per
    print(f"{n_threads * per} puts in {commits[0]} transactions")


def test_async_puts_share_transactions_without_a_thread_per_writer(
        tenant: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks of one event loop: every aput and aput_writes is durable when it returns, batches form across
    tasks, and no thread is held per waiting task (only the committer threads run)."""
    saver = MoorageSaver(tenant)
    commits = _count_commits(tenant._backend, monkeypatch)
    n_tasks, per = 24, 10
    before = threading.active_count()
    peak = before

    async def run(i: int) -> None:
        nonlocal peak
        config = {"configurable": {"thread_id": f"a{i}", "checkpoint_ns": ""}}
        for step in range(per):
            config = await saver.aput(config, _step(step), {"step": step}, {"step": step + 1})
            peak = max(peak, threading.active_count())
        await saver.aput_writes(config, [("step", "pending")], task_id=f"task-{i}")

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(n_tasks))), 120)

    asyncio.run(main())
    monkeypatch.undo()
    for i in range(n_tasks):
        listed = list(saver.list({"configurable": {"thread_id": f"a{i}"}}))
        assert [t.metadata["step"] for t in listed] == list(reversed(range(per)))
        assert listed[0].pending_writes == [(f"task-{i}", "step", "pending")]
    writes = n_tasks * (per + 1)
    assert 0 < commits[0] <= writes // 2, f"{writes} writes in {commits[0]} transactions"
    assert peak - before <= saver._commits._max_inflight


def test_a_bad_async_write_fails_alone_and_a_cancelled_waiter_still_commits(tenant: TenantStore) -> None:
    gc = GroupCommit(tenant, max_inflight=1)
    with gc._mu:
        gc._inflight = 1  # a commit "in flight": the writes queue behind it, into one batch
    good = [[(_INSERT, [("aq", "", f"ch{i}", "1", "bytes", b"x")])] for i in range(5)]
    bad = [(_INSERT, [("aq", "", "ch0", "1", "bytes", b"dup")]), ("INSERT INTO no_such_table VALUES (?)", [(1,)])]
    cancelled = [(_INSERT, [("aq", "", "gone", "1", "bytes", b"x")])]

    async def main() -> list:
        tasks = [asyncio.create_task(gc.awrite(ops)) for ops in [*good, bad, cancelled]]
        while len(gc._queue) < len(tasks):
            await asyncio.sleep(0.001)
        tasks[-1].cancel()
        with gc._mu:
            nxt = gc._pass_slot()  # hand the held slot over, as a finishing leader does
        assert nxt is not None and nxt.resume()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert results[:5] == [None] * 5
    assert isinstance(results[5], Exception) and not isinstance(results[5], asyncio.CancelledError)
    assert isinstance(results[6], asyncio.CancelledError)
    with tenant._tx(write=False) as c:
        rows = c.q("SELECT channel, blob FROM lg_blobs WHERE thread_id = 'aq' ORDER BY channel")
    # The failed write left nothing behind; the cancelled task's write was queued already and committed.
    assert [(ch, bytes(b)) for ch, b in rows] == [(f"ch{i}", b"x") for i in range(5)] + [("gone", b"x")]


def test_an_async_write_commits_on_the_loop_thread_when_no_thread_can_start(tenant: TenantStore) -> None:
    gc = GroupCommit(tenant)
    with _no_new_threads():
        asyncio.run(asyncio.wait_for(gc.awrite([(_INSERT, [("anothread", "", "w", "1", "bytes", b"x")])]), 60))
    assert gc._inflight == 0 and not gc._queue and not gc._parked
    with tenant._tx(write=False) as c:
        assert c.one("SELECT count(*) FROM lg_blobs WHERE thread_id = 'anothread'")[0] == 1


def test_aput_inside_a_caller_transaction_joins_it(tenant: TenantStore) -> None:
    """``with ts.transaction():`` around an ``await saver.aput`` on the loop's thread: the put is part of it."""
    saver = MoorageSaver(tenant)
    config = {"configurable": {"thread_id": "ajoined", "checkpoint_ns": ""}}

    async def main() -> None:
        with tenant.transaction():
            await saver.aput(config, empty_checkpoint(), {}, {})
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError, match="roll back"):
        asyncio.run(main())
    assert saver.get_tuple(config) is None


def test_put_inside_a_caller_transaction_joins_it(tenant: TenantStore) -> None:
    saver = MoorageSaver(tenant)
    config = {"configurable": {"thread_id": "joined", "checkpoint_ns": ""}}
    with pytest.raises(RuntimeError):
        with tenant.transaction():
            saver.put(config, empty_checkpoint(), {}, {})
            raise RuntimeError("abort the caller's transaction")
    assert saver.get_tuple(config) is None


@pytest.mark.parametrize("single", [True, False], ids=["one-statement", "transaction"])
def test_batched_saver_statements_isolate_a_bad_write(tenant: TenantStore, single: bool) -> None:
    """The saver's own statements, as the saver sends them (one statement per batch: moorage_lg_write on
    PostgreSQL, lg_batch on SQLite) and as a transaction (pipelined on PostgreSQL): a bad row fails alone,
    and the connection it failed on stays usable."""
    saver = MoorageSaver(tenant)
    gc = GroupCommit(tenant, max_inflight=1, single=saver._one_statement if single else None)
    sql = saver._sql
    good = [[(sql.insert_blob, [("b", "", f"ch{i}", "1", "bytes", b"x")])] for i in range(5)]
    # lg_writes.blob is NOT NULL: this job's transaction fails, and only this job's.
    bad = [(sql.insert_blob, [("b", "", "ch0", "2", "bytes", b"y")]),
           (sql.insert_write, [("b", "", "cp", "task", 0, "ch", "bytes", None, "")])]
    results: dict = {}
    _queued_batch(gc, [*good, bad], results)
    assert [results[i] for i in range(5)] == ["ok"] * 5
    assert isinstance(results[5], Exception)
    with tenant._tx(write=False) as c:
        rows = c.q("SELECT channel, version FROM lg_blobs WHERE thread_id = 'b' ORDER BY channel, version")
        assert c.q("SELECT 1 FROM lg_writes WHERE thread_id = 'b'") == []
    assert rows == [(f"ch{i}", "1") for i in range(5)]


def test_one_batch_may_upsert_the_same_checkpoint_twice(tenant: TenantStore) -> None:
    """Two queued puts of the same checkpoint id share a batch: the multi-row upsert keeps one (no error)."""
    saver = MoorageSaver(tenant)
    gc = saver._commits
    cfg = {"configurable": {"thread_id": "dup", "checkpoint_ns": ""}}
    ops = []
    saver._commits = type("Capture", (), {"write": lambda self, o: ops.append(o)})()
    for v in ("first", "second"):
        cp = empty_checkpoint()
        cp["id"] = "same-id"
        cp["channel_values"] = {"v": v}
        cp["channel_versions"] = {"v": 1}
        saver.put(cfg, cp, {}, {"v": 1})
    saver._commits = gc
    results: dict = {}
    _queued_batch(gc, ops, results)
    assert results == {0: "ok", 1: "ok"}
    got = saver.get_tuple(cfg)
    assert got is not None and got.checkpoint["channel_values"]["v"] in ("first", "second")


def test_a_second_transaction_runs_alongside_only_for_a_full_batch(tenant: TenantStore) -> None:
    """With two slots, a finishing leader hands its slot on only if it is the last one in flight or a full
    batch (``extra_min`` writers) waits; otherwise it frees the slot and the other leader takes the queue."""
    from moorage.store.langgraph_commit import _Job

    from moorage.store.langgraph_commit import _Committer

    gc = GroupCommit(tenant, max_inflight=2, extra_min=3)
    with gc._mu:
        gc._writers = 8  # many writers about (see the next test for few)
        gc._inflight = 2
        gc._queue = [_Job([]) for _ in range(2)]
        assert gc._pass_slot() is None and gc._inflight == 1  # two waiting: not enough for a second one
        gc._inflight = 2
        gc._queue.append(_Job([]))
        # A full batch waits: the slot stays in use, handed to a committer (which takes the queue itself).
        assert isinstance(gc._pass_slot(), _Committer) and gc._inflight == 2 and len(gc._queue) == 3
        gc._inflight = 1
        gc._queue = [_Job([])]
        assert isinstance(gc._pass_slot(), _Committer) and gc._inflight == 1  # the last slot always serves
        gc._queue = []
        assert gc._pass_slot() is None and gc._inflight == 0


def test_few_writers_get_a_second_transaction_without_waiting_for_a_full_batch(tenant: TenantStore) -> None:
    """With two slots and two writer threads about, a writer that finds the other's transaction in flight
    starts its own at once (as a saver with a connection per writer does) instead of waiting for
    ``extra_min`` writers that never come; with many writers about it still waits for a full batch."""
    gc = GroupCommit(tenant, max_inflight=2, extra_min=4)
    both = threading.Barrier(2)  # both alive at once: two distinct thread ids

    def burst(tag: str) -> None:
        both.wait(timeout=60)
        for j in range(40):
            gc.write([(_INSERT, [("t", "", tag, str(j), "bytes", b"x")])])

    threads = [threading.Thread(target=burst, args=(f"w{i}",), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert gc._writers == 2  # counted from the commits of the last _WINDOW
    with gc._mu:
        gc._inflight = gc._committing = 1  # the other writer's transaction is in flight

    # One write: its decision is taken with the two writers counted (a recount after later commits
    # would also count this thread, unless it reuses a finished writer's thread id).
    lone = threading.Thread(target=gc.write, args=([(_INSERT, [("t", "", "lone", "0", "bytes", b"x")])],), daemon=True)
    lone.start()
    lone.join(timeout=20)
    assert not lone.is_alive(), "a writer waited for a full batch that never came"
    with tenant._tx() as c:
        assert c.one("SELECT count(*) FROM lg_blobs WHERE channel = 'lone'")[0] == 1
    with gc._mu:
        assert gc._inflight == 1 and gc._committing == 1 and not gc._queue
        gc._writers = 8
        assert gc._second_min() == 4  # many writers: a second transaction only for a full batch
        gc._inflight = gc._committing = 0


def test_two_slots_commit_every_concurrent_writer(tenant: TenantStore) -> None:
    """Many threads through two slots: every write commits exactly once, none is left waiting."""
    gc = GroupCommit(tenant, max_inflight=2, extra_min=2)
    n = 24
    results: dict = {}

    def writer(i: int) -> None:
        for j in range(5):
            gc.write([(_INSERT, [("t", "", f"w{i}", str(j), "bytes", b"x")])])
        results[i] = "ok"

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: "ok" for i in range(n)}
    with tenant._tx() as c:
        assert c.one("SELECT count(*) FROM lg_blobs WHERE thread_id = 't'")[0] == n * 5
    # A committer thread gives its slot back once it finds the queue empty, just after waking its writers.
    deadline = time.monotonic() + 10
    while gc._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc._inflight == 0 and not gc._queue


def test_batch_columns_reach_postgresql_as_typed_arrays(pg_url: str) -> None:
    """The batch's binary array parameters (built without psycopg's per-element type lookup) round-trip
    NULLs, non-ASCII text, empty and binary bytes, and integers."""
    import psycopg

    from moorage.store.langgraph_sql import BatchInsert

    spec = BatchInsert("t", "a, b, c", ("text", "bytea", "integer"), "")
    rows = [("é✓", b"\x00\xff", -7), (None, b"", 2**31 - 1), ("", None, None)]
    cols = spec.columns(rows)
    with psycopg.connect(pg_url) as conn:
        got = conn.execute("SELECT %b::text[], %b::bytea[], %b::integer[]", cols).fetchone()
    assert got == (["é✓", None, ""], [b"\x00\xff", b"", None], [-7, 2**31 - 1, None])


def test_one_statement_batches_store_what_transactions_store(tenant: TenantStore) -> None:
    """Every kind of saver row (checkpoint upsert, channel blob, pending write kept, pending write replaced),
    repeated keys included, leaves the same rows whether the batch ran as one statement (lg_batch /
    moorage_lg_write) or as a transaction of the statements themselves, and one statement means one
    ``tenant_call`` per batch."""
    saver = MoorageSaver(tenant)
    sql = saver._sql

    def batch(thread: str) -> list:
        cp = (thread, "", "c1", None, "run", "msgpack", b"\x01", "{}", "{}")
        return [
            (sql.insert_blob, [(thread, "", "ch", "1", "bytes", b"a"), (thread, "", "ch", "1", "bytes", b"ignored")]),
            (sql.upsert_checkpoint, [cp, cp[:6] + (b"\x02",) + cp[7:]]),
            (sql.insert_write, [(thread, "", "c1", "task", 0, "ch", "bytes", b"w1", ""),
                                (thread, "", "c1", "task", 0, "ch", "bytes", b"ignored", "")]),
            (sql.upsert_write, [(thread, "", "c1", "task", -1, "__error__", "bytes", b"e1", "p"),
                                (thread, "", "c1", "task", -1, "__error__", "bytes", b"e2", "p2")]),
        ]

    calls = []
    backend = tenant._backend
    real_call = backend.tenant_call
    backend.tenant_call = lambda *a: (calls.append(a[1]), real_call(*a))[1]  # type: ignore[method-assign]
    try:
        GroupCommit(tenant, single=saver._one_statement).write(batch("one"))
    finally:
        backend.__dict__.pop("tenant_call", None)
    GroupCommit(tenant).write(batch("tx"))
    assert len(calls) == 1

    def rows(thread: str) -> list:
        with tenant._tx(write=False) as c:
            return [
                [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r[1:]) for r in c.q(q, (thread,))]
                for q in ("SELECT thread_id, checkpoint_ns, channel, version, type, blob FROM lg_blobs WHERE thread_id = ?",
                          "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_id, run_id, type, checkpoint, metadata, "
                          "versions FROM lg_checkpoints WHERE thread_id = ?",
                          "SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, task_path "
                          "FROM lg_writes WHERE thread_id = ? ORDER BY idx")
            ]

    got = rows("one")
    assert got == rows("tx")
    assert got[0] == [("", "ch", "1", "bytes", b"a")]
    assert [r[5] for r in got[1]] == [b"\x02"]
    assert [(r[3], r[6]) for r in got[2]] == [(-1, b"e2"), (0, b"w1")]

    # A batch for one table alone is one plain multi-row INSERT on SQLite (no view: SQLite copies the rows of
    # an INSERT that fires row triggers into a temporary table first), with the same conflict rules.
    for i, part in enumerate(batch("x")):
        calls.clear()
        backend.tenant_call = lambda *a: (calls.append(a[1]), real_call(*a))[1]  # type: ignore[method-assign]
        try:
            GroupCommit(tenant, single=saver._one_statement).write([(part[0], [(f"one{i}",) + r[1:] for r in part[1]])])
        finally:
            backend.__dict__.pop("tenant_call", None)
        GroupCommit(tenant).write([(part[0], [(f"tx{i}",) + r[1:] for r in part[1]])])
        assert len(calls) == 1
        if tenant.dialect == "sqlite":
            assert "lg_batch" not in calls[0] and calls[0].startswith("INSERT INTO lg_")
        assert rows(f"one{i}") == rows(f"tx{i}") != [[], [], []]
