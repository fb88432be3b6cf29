"""``PostgresBackend.tenant_call``'s path: prepared once per connection, one round trip, GIL released.

Runs against a real PostgreSQL cluster (the session's throwaway one).
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from moorage.store.pg_prepared import PreparedCalls, convert
from moorage.store.postgres import PostgresBackend


def test_placeholders_become_numbered_parameters() -> None:
    q = convert("SELECT %s, %b::bytea, %t, 'a%%b' || %s")
    assert q.raw == b"SELECT $1, $2::bytea, $3, 'a%b' || $4"
    assert [f.name for f in q.formats] == ["AUTO", "BINARY", "TEXT", "AUTO"]


@pytest.mark.parametrize("sql", ["SELECT %(name)s", "SELECT 'x' LIKE 'a%'", "SELECT 1 %"])
def test_unsupported_placeholders_are_refused(sql: str) -> None:
    with pytest.raises(psycopg.ProgrammingError, match="unsupported placeholder"):
        convert(sql)


@pytest.fixture
def backend(pg_url: str):
    b = PostgresBackend(pg_url, pool_size=1)  # one pooled connection: every call below reuses it
    yield b
    b.close()


def _prepared_names(b: PostgresBackend) -> list[str]:
    with b._pool.connection() as conn:
        return [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements ORDER BY name").fetchall()]


def test_a_statement_is_prepared_once_per_connection_and_commits(backend: PostgresBackend) -> None:
    calls = PreparedCalls()
    with backend._pool.connection() as conn:
        conn.execute("CREATE TEMP TABLE t (k text, v bytea)")
        for i in range(5):
            calls.run(conn, "INSERT INTO t VALUES (%s, %b)", (f"k{i}", bytes([i]) * 3))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # autocommitted
        assert conn.execute("SELECT k, v FROM t ORDER BY k").fetchall() == [(f"k{i}", bytes([i]) * 3) for i in range(5)]
        assert [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements").fetchall()] == ["moorage_call_0"]


def test_a_failing_statement_raises_its_psycopg_error_and_leaves_the_connection_usable(backend: PostgresBackend) -> None:
    calls = PreparedCalls()
    with backend._pool.connection() as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            calls.run(conn, "SELECT 1 / %s::int", (0,))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        calls.run(conn, "SELECT 1 / %s::int", (1,))
        with pytest.raises(psycopg.ProgrammingError, match="2 parameters"):
            calls.run(conn, "SELECT 1 / %s::int", (1, 2))


def test_a_statement_the_server_forgot_is_prepared_again(backend: PostgresBackend) -> None:
    """DEALLOCATE ALL (or DISCARD ALL by a pooler) drops the server's copy: the call prepares it anew."""
    calls = PreparedCalls()
    with backend._pool.connection() as conn:
        conn.execute("CREATE TEMP TABLE t (k text)")
        calls.run(conn, "INSERT INTO t VALUES (%s)", ("a",))
        conn.execute("DEALLOCATE ALL")
        calls.run(conn, "INSERT INTO t VALUES (%s)", ("b",))
        assert [r[0] for r in conn.execute("SELECT k FROM t ORDER BY k").fetchall()] == ["a", "b"]


def test_a_lost_connection_is_an_operational_error_and_the_pool_replaces_it(backend: PostgresBackend,
                                                                            pg_cluster) -> None:
    calls = PreparedCalls()
    with backend._pool.connection() as conn:
        calls.run(conn, "SELECT %s::int", (1,))
        pid = conn.info.backend_pid
    pg_cluster.psql(f"SELECT pg_terminate_backend({pid})")
    with pytest.raises(psycopg.OperationalError):
        with backend._pool.connection() as conn:
            calls.run(conn, "SELECT %s::int", (1,))
    with backend._pool.connection() as conn:
        assert conn.info.backend_pid != pid
        calls.run(conn, "SELECT %s::int", (1,))


def test_beyond_its_share_of_prepared_statements_a_call_runs_unnamed(backend: PostgresBackend) -> None:
    calls = PreparedCalls()
    with backend._pool.connection() as conn:
        for i in range(20):
            calls.run(conn, f"SELECT %s::int + {i}", (i,))
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 16


def test_other_threads_run_python_during_the_round_trip(backend: PostgresBackend) -> None:
    calls = PreparedCalls()
    spins = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        with backend._pool.connection() as conn:
            before = spins[0]
            t0 = time.perf_counter()
            calls.run(conn, "SELECT pg_sleep(%s)", (0.3,))
            assert time.perf_counter() - t0 >= 0.3
            during = spins[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, f"the spinning thread made {during} iterations while the statement slept: GIL held?"


def test_tenant_call_writes_only_for_its_tenant(backend: PostgresBackend) -> None:
    """The group commit's statement through tenant_call: rows land under the calling tenant only."""
    from moorage.store.langgraph_sql import Statements

    ids = [backend.create_tenant(n).id for n in ("acme", "globex")]
    sql = Statements("postgres")
    row = ("thread", "", "cp1", None, None, "msgpack", b"\x80", "{}", "{}")
    one = sql.batch([(sql.upsert_checkpoint, [row])])
    assert one is not None
    backend.tenant_call(ids[0], *one)
    backend.tenant_call(ids[0], *one)  # the prepared statement again: an upsert, still one row
    with backend.tenant_tx(ids[0]) as c:
        assert c.q("SELECT thread_id, checkpoint_id FROM lg_checkpoints") == [("thread", "cp1")]
    with backend.tenant_tx(ids[1]) as c:
        assert c.q("SELECT count(*) FROM lg_checkpoints") == [(0,)]
    assert "moorage_call_0" in _prepared_names(backend)


def test_checkpoint_reads_scope_themselves_to_the_tenant_given_and_only_for_that_statement(
        backend: PostgresBackend) -> None:
    """migration 9's moorage_lg_get, as the saver calls it: rows of the calling tenant only; the tenant
    setting it makes ends with its statement; no tenant, no rows."""
    from moorage.store.langgraph_sql import Statements

    ids = [backend.create_tenant(n).id for n in ("acme", "globex")]
    sql = Statements("postgres")
    write = sql.batch([(sql.upsert_checkpoint, [("thread", "", "cp1", None, None, "msgpack", b"\x80", "{}", "{}")])])
    assert write is not None
    backend.tenant_call(ids[0], *write)
    latest = backend.tenant_call(ids[0], sql.get_call, ("thread", "", None))
    assert [(r[0], r[1], r[5]) for r in latest] == [(0, "cp1", b"\x80")]
    assert backend.tenant_call(ids[0], sql.get_call, ("thread", "", "cp1")) == latest
    assert backend.tenant_call(ids[0], sql.get_call, ("thread", "", "cp2")) == []
    assert backend.tenant_call(ids[1], sql.get_call, ("thread", "", None)) == []
    with backend._pool.connection() as conn:  # the pool's only connection: the one the calls above used
        assert conn.execute("SELECT current_setting('moorage.tenant_id', true)").fetchone()[0] in (None, "")
        assert conn.execute("SELECT count(*) FROM lg_checkpoints").fetchone()[0] == 0
        with pytest.raises(psycopg.errors.RaiseException, match="needs a tenant"):
            conn.execute("SELECT * FROM moorage_lg_get('', 'thread', '', NULL)")
