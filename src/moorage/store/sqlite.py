"""The embedded SQLite backend: control plane in one file, each tenant's data in its own file.

Files live under ``<data_dir>/store``; WAL journaling with ``synchronous=FULL`` so every acknowledged
commit is on disk. Write transactions take the lock up front (``BEGIN IMMEDIATE``) to avoid upgrade deadlocks.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Sequence

from moorage.errors import UnavailableError
from moorage.fds import raise_open_files_limit
from moorage.store.base import Backend, check_tenant_id, translate_integrity
from moorage.store.bloblog import BlobLog, live_locators, load_position
from moorage.store.schema import (CONTROL_MIGRATIONS, TENANT_MIGRATIONS, Migration, recorded_name, refuse_newer_schema,
                                  statements_for)
from moorage.store.sql import Conn

_BUSY_TIMEOUT_MS = 60_000
_CONNS_PER_THREAD = 64


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000)
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    if path != ":memory:":
        conn.execute("PRAGMA journal_mode = WAL")
    # FULL: the WAL is fsynced at every commit, so an acknowledged write survives power loss.
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA temp_store = MEMORY")
    # Deleted rows are overwritten, not just unlinked: forgetting a user must leave no bytes of them behind.
    conn.execute("PRAGMA secure_delete = ON")
    return conn


def migrate(conn: sqlite3.Connection, migrations: tuple[Migration, ...], upto: int | None = None) -> int:
    """Apply missing migrations in one immediate transaction each; safe with concurrent openers."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)")
    newest = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
    refuse_newer_schema(int(newest), migrations, lambda known: [r[0] for r in conn.execute(
        "SELECT name FROM schema_migrations WHERE version > ?", (known,)).fetchall()])
    for m in migrations:
        if upto is not None and m.version > upto:
            break
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("SELECT 1 FROM schema_migrations WHERE version = ?", (m.version,)).fetchone():
                conn.execute("COMMIT")
                continue
            for stmt in statements_for(m, "sqlite"):
                conn.execute(stmt)
            conn.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (m.version, recorded_name(m), time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()
    return int(row[0])


class _Held:
    """One thread's connection to one file. Only the owning thread's ``threading.local`` holds it strongly,
    so when that thread ends the connection is closed (a host whose threads come and go does not keep one
    open connection, descriptor and page cache per dead thread).

    ``lock`` is held while the owner uses the connection: another thread that closes it (the store closing,
    a tenant dropped) waits for the statement or transaction in progress instead of freeing the database
    under it, which crashes the process inside SQLite."""

    __slots__ = ("conn", "path", "lock", "depth", "closed", "__weakref__")

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self.conn = conn
        self.path = path
        self.lock = threading.RLock()
        self.depth = 0  # the owner's nesting of ``_Files.use`` (only changed under ``lock``)
        self.closed = False

    def close(self, wait_s: float) -> None:
        """Close now if no thread is using the connection, else as soon as its user lets go of it (after
        ``wait_s``, the user closes it itself on its way out)."""
        self.closed = True
        if self.lock.acquire(timeout=wait_s):
            try:
                if self.depth == 0:
                    with contextlib.suppress(Exception):
                        self.conn.close()
            finally:
                self.lock.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class _Files:
    """Per-thread connections to a set of database files (sqlite3 connections are not shareable concurrently).

    A thread keeps at most ``per_thread`` of them open, least recently used closed first (never one inside
    a transaction): a worker thread that served thousands of tenants does not hold thousands of
    connections, descriptors and page caches. Every use goes through ``use``."""

    #: How long closing waits for another thread's transaction on a connection before leaving the close to it.
    CLOSE_WAIT_S = 30.0

    def __init__(self, per_thread: int = _CONNS_PER_THREAD) -> None:
        self._local = threading.local()
        self._all: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._per_thread = max(1, per_thread)
        self._closed = False

    def _held(self, path: str) -> _Held:
        if self._closed:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        conns: OrderedDict[str, _Held] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = OrderedDict()
        held = conns.get(path)
        if held is not None and held.closed and held.depth == 0:
            del conns[path]  # closed by another thread (a dropped tenant, say): open a fresh one
            held = None
        if held is None:
            if len(conns) >= self._per_thread:
                self._evict(conns)
            held = conns[path] = _Held(_connect(path), path)
            with self._lock:
                self._all.add(held)
        else:
            conns.move_to_end(path)
        return held

    @contextlib.contextmanager
    def use(self, path: str) -> Iterator[sqlite3.Connection]:
        """This thread's connection to ``path``, kept open until the block ends."""
        held = self._held(path)
        with held.lock:
            held.depth += 1
            try:
                yield held.conn
            finally:
                held.depth -= 1
                if held.closed and held.depth == 0:  # closed by another thread meanwhile: it left this to us
                    with contextlib.suppress(Exception):
                        held.conn.close()

    def _evict(self, conns: "OrderedDict[str, _Held]") -> None:
        for path, held in conns.items():
            if not held.conn.in_transaction and held.depth == 0:
                del conns[path]
                with self._lock:
                    self._all.discard(held)
                held.close(0)
                return

    def open_count(self) -> int:
        with self._lock:
            return len(self._all)

    def drop(self, path: str) -> None:
        with self._lock:
            helds = [h for h in self._all if h.path == path]
            for held in helds:
                self._all.discard(held)
        for held in helds:
            held.close(self.CLOSE_WAIT_S)
        conns = getattr(self._local, "conns", None)
        if conns:
            conns.pop(path, None)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            helds = list(self._all)
            self._all.clear()
        for held in helds:
            held.close(self.CLOSE_WAIT_S)


def _log_dir(tenant_db: str) -> Path:
    """A tenant's blob-log directory, next to its database file (``<tenant>.lg``)."""
    return Path(tenant_db[: -len(".db")] + ".lg")


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection, write: bool) -> Iterator[Conn]:
    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
    try:
        with translate_integrity(sqlite3.IntegrityError):
            yield Conn(conn, "sqlite")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    else:
        conn.execute("COMMIT")


class SQLiteBackend(Backend):
    dialect = "sqlite"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            (self.root / "tenants").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UnavailableError(f"cannot create the store directory {self.root}: {e}", hint="check MOORAGE_DATA_DIR") from e
        os.chmod(self.root, 0o700)
        raise_open_files_limit()  # a connection or two per tenant per thread
        self._files = _Files()
        self._migrated: set[str] = set()
        self._mlock = threading.Lock()
        self._control = str(self.root / "control.db")
        self._logs: dict[str, BlobLog] = {}
        self._paths: dict[str, str] = {}
        with self._files.use(self._control) as conn:
            migrate(conn, CONTROL_MIGRATIONS)

    def tenant_path(self, tenant_id: str) -> Path:
        return self.root / "tenants" / f"{check_tenant_id(tenant_id)}.db"

    def _tenant_file(self, tenant_id: str) -> str:
        # Every transaction comes through here: the checked path string is cached per tenant id.
        path = self._paths.get(tenant_id)
        if path is None:
            path = str(self.tenant_path(tenant_id))
            if len(self._paths) > 4096:
                self._paths.clear()
            self._paths[tenant_id] = path
        if path not in self._migrated:
            with self._mlock:
                if not os.path.exists(path):
                    # Only tenants created through the control plane have a file; never create one on read.
                    from moorage.errors import TenantScopeError

                    raise TenantScopeError(f"unknown tenant {tenant_id}")
                with self._files.use(path) as conn:
                    migrate(conn, TENANT_MIGRATIONS)
                self._migrated.add(path)
        return path

    def _tenant_conn(self, tenant_id: str) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self._files.use(self._tenant_file(tenant_id))

    @contextlib.contextmanager
    def tenant_tx(self, tenant_id: str, *, write: bool = True) -> Iterator[Conn]:
        with self._tenant_conn(tenant_id) as conn, _transaction(conn, write) as c:
            yield c

    def tenant_call(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        # In autocommit mode one statement is one transaction: SQLite takes the write lock (waiting like
        # BEGIN IMMEDIATE), runs it and commits, fsync included, inside one call that releases the GIL once.
        with self._tenant_conn(tenant_id) as conn:
            if conn.in_transaction:
                raise RuntimeError("tenant_call inside an open transaction would not commit on return")
            with translate_integrity(sqlite3.IntegrityError):
                return conn.execute(sql, params).fetchall()

    def tenant_read(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        # In autocommit mode one SELECT reads one consistent WAL snapshot: no BEGIN/COMMIT round needed.
        with self._tenant_conn(tenant_id) as conn:
            return conn.execute(sql, tuple(params)).fetchall()

    @contextlib.contextmanager
    def control_tx(self) -> Iterator[Conn]:
        with self._files.use(self._control) as conn, _transaction(conn, True) as c:
            yield c

    def authenticate_hash(self, key_hash: str) -> tuple[str, str, str, float | None] | None:
        with self._files.use(self._control) as conn, _transaction(conn, False) as c:
            r = c.one("SELECT id, tenant_id, scopes, revoked_at FROM api_keys WHERE key_hash = ?", (key_hash,))
        return None if r is None else (r[0], r[1], r[2], r[3])

    def init_tenant(self, tenant_id: str, upto: int | None = None) -> None:
        path = str(self.tenant_path(tenant_id))
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        with self._files.use(path) as conn:
            migrate(conn, TENANT_MIGRATIONS, upto=upto)
        if upto is None:
            self._migrated.add(path)

    def blob_log(self, tenant_id: str) -> BlobLog:
        path = str(self.tenant_path(tenant_id))
        log = self._logs.get(path)
        if log is None:
            self._tenant_file(tenant_id)  # an unknown tenant gets the same error as any other access
            with self._mlock:
                log = self._logs.setdefault(path, BlobLog(_log_dir(path)))
        return log

    def vacuum_blobs(self, tenant_id: str) -> tuple[int, int]:
        log = self.blob_log(tenant_id)
        if not log.segments():
            return 0, 0
        with self._tenant_conn(tenant_id) as conn:
            # The scan of every row that holds a locator, and the punching, run from a read snapshot: writers
            # go on meanwhile (see BlobLog.vacuum), the write lock is taken only to unlink a segment.
            with _transaction(conn, False) as c:
                position = load_position(c)
                live = live_locators(c) if position is not None else []
            if position is not None:
                return log.vacuum(live, position, locked=lambda: _transaction(conn, True))
            # No recorded end (a log written before migration 7): its end is the newest file's size, which
            # only the write lock keeps still.
            with _transaction(conn, True) as c:
                return log.vacuum(live_locators(c), load_position(c))

    def drop_tenant(self, tenant_id: str) -> None:
        path = str(self.tenant_path(tenant_id))
        self._migrated.discard(path)  # first: a thread that lets go of its connection below finds no tenant
        self._files.drop(path)
        with self._mlock:
            log = self._logs.pop(path, None)
        (log or BlobLog(_log_dir(path))).destroy()
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + suffix)

    def purge(self, tenant_id: str) -> None:
        """After an erasure: merge the full-text index (dropping deleted terms) and empty the WAL into the file."""
        with self._tenant_conn(tenant_id) as conn:
            conn.execute("INSERT INTO events_fts(events_fts) VALUES ('optimize')")
            self.vacuum_blobs(tenant_id)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def schema_version(self, tenant_id: str | None = None) -> int:
        with self._files.use(self._control if tenant_id is None else str(self.tenant_path(tenant_id))) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0])

    def describe(self) -> str:
        return f"sqlite {sqlite3.sqlite_version} at {self.root} (WAL, synchronous=FULL)"

    def close(self) -> None:
        with self._mlock:
            logs = list(self._logs.values())
            self._logs.clear()
        for log in logs:
            log.close()
        self._files.close()


class EphemeralBackend(Backend):
    """Zero-retention storage for stateless agents: one in-memory SQLite database, never on disk."""

    dialect = "sqlite"
    ephemeral = True

    def __init__(self, tenant_id: str) -> None:
        self.tenant_id = check_tenant_id(tenant_id)
        self._conn = _connect(":memory:")
        self._lock = threading.RLock()
        migrate(self._conn, TENANT_MIGRATIONS)

    @contextlib.contextmanager
    def tenant_tx(self, tenant_id: str, *, write: bool = True) -> Iterator[Conn]:
        if tenant_id != self.tenant_id:
            from moorage.errors import TenantScopeError

            raise TenantScopeError("an ephemeral store serves one tenant only")
        with self._lock, _transaction(self._conn, write) as c:
            yield c

    def control_tx(self) -> contextlib.AbstractContextManager[Conn]:
        from moorage.errors import TenantScopeError

        raise TenantScopeError("an ephemeral store has no control plane")

    def authenticate_hash(self, key_hash: str) -> None:
        return None

    def init_tenant(self, tenant_id: str) -> None:
        pass

    def drop_tenant(self, tenant_id: str) -> None:
        self.close()

    def schema_version(self, tenant_id: str | None = None) -> int:
        return int(self._conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])

    def describe(self) -> str:
        return "ephemeral in-memory sqlite (zero retention)"

    def close(self) -> None:
        with self._lock, contextlib.suppress(Exception):  # never under a transaction of another thread
            self._conn.close()
