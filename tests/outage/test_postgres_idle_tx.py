"""A host frozen in the middle of a transaction (between two of its statements: its connection open, its kernel
answering) does not hold the rows it locked for good: the server ends a session idle in a transaction after
``IDLE_IN_TRANSACTION_S`` (an operator's own ``options`` in the store URL win), and another host's write of those
rows goes through. Before, a fleet host frozen in a fenced turn's commit kept its instance's record share-locked,
and every other host's forget or takeover of the instance waited on it forever."""

from __future__ import annotations

import threading
import time
from urllib.parse import quote

from moorage.store.pg_outage import IDLE_IN_TRANSACTION_S
from moorage.store.postgres import PostgresBackend


def _setting(conn) -> str:  # noqa: ANN001
    return conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0]


def test_every_connection_ends_a_transaction_left_idle_past_the_default(pg_url: str) -> None:
    backend = PostgresBackend(pg_url)
    try:
        with backend._pool.connection() as pooled:
            assert _setting(pooled) == f"{IDLE_IN_TRANSACTION_S}s"
        assert _setting(backend._owner) == f"{IDLE_IN_TRANSACTION_S}s"
    finally:
        backend.close()


def test_a_session_frozen_in_a_transaction_lets_go_of_its_locks_and_the_urls_own_setting_wins(pg_url: str) -> None:
    url = pg_url + "?options=" + quote("-c idle_in_transaction_session_timeout=1500")
    frozen, other = PostgresBackend(url), PostgresBackend(url)
    try:
        with frozen._pool.connection() as pooled:
            assert _setting(pooled) == "1500ms"  # the URL's, not the default
        with other.control_tx() as c:
            c.x("INSERT INTO hosts (id, url, state, started_at, heartbeat_at, incarnation, load, version) "
                "VALUES ('h9', 'http://h9', 'active', 0, 0, 'i1', '{}', 1)")
        stuck = frozen._owner  # the control plane's connection, as a heartbeat or a claim of a delivery uses it
        stuck.execute("BEGIN")
        stuck.execute("UPDATE hosts SET version = version + 1 WHERE id = 'h9'")  # then nothing: the host froze
        done = threading.Event()

        def write() -> None:
            with other.control_tx() as c:
                c.x("UPDATE hosts SET heartbeat_at = 1 WHERE id = 'h9'")  # waits on the frozen session's lock
            done.set()

        t0 = time.monotonic()
        threading.Thread(target=write, daemon=True).start()
        assert done.wait(30), "the write still waits on the frozen session's lock"
        assert 1.0 <= time.monotonic() - t0 < 15
        time.sleep(0.2)
        assert _ended(stuck)  # the server ended the frozen session
        with other.control_tx() as c:
            assert c.one("SELECT version, heartbeat_at FROM hosts WHERE id = 'h9'") == (1, 1)  # nothing of it kept
    finally:
        frozen.close()
        other.close()


def _ended(conn) -> bool:  # noqa: ANN001
    try:
        conn.execute("SELECT 1")
    except Exception as e:  # noqa: BLE001
        return "idle-in-transaction" in str(e) or conn.closed or conn.broken
    return False
