"""The checkpointers the store bench compares, each opened with its documented setup at equal durability.

SQLite: WAL journal, synchronous=FULL for both savers. PostgreSQL: one throwaway cluster with fsync=on and
synchronous_commit=on, shared by moorage's PostgreSQL backend and langgraph-checkpoint-postgres.
"""

from __future__ import annotations

import sqlite3
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.sqlite import SqliteSaver
from psycopg import Connection
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from moorage.store import Store
from moorage.store.langgraph import MoorageSaver
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend


@dataclass
class Contender:
    name: str
    backend: str  # "sqlite" | "postgres"
    #: One saver per worker thread (index -> saver); may return the same shared object every time.
    saver_for: Callable[[int], BaseCheckpointSaver]
    settings: str
    #: Called before each throughput cell: puts the contender's connections back in their starting state.
    reset: Callable[[], None] = lambda: None


def versus(samples: dict[str, list[float]], **fields: Any) -> dict[str, Any]:
    """A result row from one cell's samples, moorage's first and its peer's second: ``fields``, the peer's name,
    both medians, their ratio and every sample."""
    (_, mine), (peer, theirs) = samples.items()
    row = {**fields, "peer": peer, "moorage_per_s": statistics.median(mine), "peer_per_s": statistics.median(theirs),
           "samples": samples}
    row["ratio"] = row["moorage_per_s"] / row["peer_per_s"]
    return row


def peer_versions() -> dict[str, str]:
    return {p: version(p) for p in ("langgraph-checkpoint", "langgraph-checkpoint-sqlite", "langgraph-checkpoint-postgres",
                                   "langgraph", "psycopg")}


def _sqlite_peer_conn(path: Path) -> sqlite3.Connection:
    # The documented setup (sqlite3.connect(..., check_same_thread=False)), raised to moorage's durability.
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def open_contenders(stack: ExitStack, tmp: Path, pg_owner_url: Callable[[str], str], workers: int) -> list[Contender]:
    out: list[Contender] = []

    store = stack.enter_context(Store(SQLiteBackend(tmp / "moorage-store")))
    _, key = store.operator.create_tenant("bench")
    ms = MoorageSaver(store.tenant(store.authenticate(key.secret)))
    out.append(Contender("moorage", "sqlite", lambda i: ms, "file per tenant, WAL, synchronous=FULL"))

    # SqliteSaver serialises every call on one connection behind a lock; give each worker its own
    # saver and connection to the same file so the peer is not held back by that lock.
    peer_path = tmp / "peer.sqlite"
    sq_savers: dict[int, SqliteSaver] = {}

    def sqlite_saver(i: int) -> SqliteSaver:
        if i not in sq_savers:
            conn = _sqlite_peer_conn(peer_path)
            stack.callback(conn.close)
            sq_savers[i] = SqliteSaver(conn)
            sq_savers[i].setup()
        return sq_savers[i]

    sqlite_saver(0)
    out.append(Contender("SqliteSaver", "sqlite", sqlite_saver, "one connection per worker, WAL, synchronous=FULL"))

    pg_store = stack.enter_context(Store(PostgresBackend(pg_owner_url("moorage_bench"), pool_size=max(10, workers))))
    _, key = pg_store.operator.create_tenant("bench")
    mp = MoorageSaver(pg_store.tenant(pg_store.authenticate(key.secret)))
    out.append(Contender("moorage", "postgres", lambda i: mp, "app role, forced RLS, pool"))

    peer_url = pg_owner_url("peer_bench")
    with Connection.connect(peer_url, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        PostgresSaver(conn).setup()
    # The documented pool setup: autocommit, prepare_threshold=0, dict_row. Opened anew for every throughput
    # cell (``reset``): the pool grows on demand and keeps idle connections for 10 minutes, handing them out
    # in turn, so after a 32-writer cell 8 writers went through 32 server processes: PostgresSaver 1 KiB
    # `full` at 8 writers 3,300-4,800 puts/s with 0.43-0.50 ms of CPU per put against 6,700-8,300 and
    # 0.23-0.25 ms with a pool grown by those 8 writers alone. Without the reset only the first PostgreSQL
    # cell saw the latter. moorage's pool needs no reset: group commit uses two connections at a time.
    pool: list[ConnectionPool] = []
    # PostgresSaver also holds a per-instance lock around every call: one instance per worker.
    pg_savers: dict[int, PostgresSaver] = {}

    def open_pool() -> None:
        if pool:
            pool.pop().close()
        pg_savers.clear()
        pool.append(ConnectionPool(peer_url, min_size=1, max_size=max(10, workers), open=True,
                                   kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}))

    open_pool()
    stack.callback(lambda: pool and pool.pop().close())

    def pg_saver(i: int) -> PostgresSaver:
        return pg_savers.setdefault(i, PostgresSaver(pool[0]))

    out.append(Contender("PostgresSaver", "postgres", pg_saver,
                         "one saver per worker on a ConnectionPool(autocommit, prepare_threshold=0), opened anew per cell",
                         reset=open_pool))
    return out
