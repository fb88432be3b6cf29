"""The PostgreSQL backend: one database for all tenants, isolated by forced row-level security.

Migrations run as the owner role; the application connects as a separate non-owner role without
BYPASSRLS, and every transaction sets ``moorage.tenant_id`` locally, which every policy checks.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql as psql
from psycopg_pool import ConnectionPool, PoolTimeout

from moorage.errors import ConfigError, UnavailableError
from moorage.store.base import Backend, check_tenant_id, translate_contention, translate_integrity
from moorage.store.pg_outage import (CONNECT_WAIT_S, StoreUnreachable, connect_defaults, is_connection_lost,
                                     quiet_pool_warnings, read_only, stale, unreachable_as_503)
from moorage.store.pg_prepared import PreparedCalls
from moorage.store.schema import (CONTROL_MIGRATIONS, TENANT_MIGRATIONS, Migration, recorded_name, refuse_newer_schema,
                                  statements_for)
from moorage.store.sql import Conn

_ROLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_LOCK_ID = 0x6D6F6F72  # "moor": serialises concurrent migrators
T = TypeVar("T")
#: A transaction the server aborted to break a deadlock (40P01) or a serialization failure (40001): retryable.
_CONTENTION = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def derive_app_url(owner_url: str, role: str) -> str:
    """The owner's URL with the user swapped for the application role (password from PGPASSFILE/.pgpass)."""
    parts = urlsplit(owner_url)
    host = parts.hostname or ""
    netloc = f"{role}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _apply(conn: psycopg.Connection, component: str, migrations: tuple[Migration, ...], tenant: bool,
           app_role: str, upto: int | None) -> None:
    newest = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations WHERE component = %s",
                          (component,)).fetchone()
    refuse_newer_schema(int(newest[0]), migrations, lambda known: [r[0] for r in conn.execute(
        "SELECT name FROM schema_migrations WHERE component = %s AND version > %s", (component, known)).fetchall()])
    for m in migrations:
        if upto is not None and m.version > upto:
            break
        with conn.transaction():
            if conn.execute("SELECT 1 FROM schema_migrations WHERE component = %s AND version = %s", (component, m.version)).fetchone():
                continue
            for stmt in statements_for(m, "postgres"):
                conn.execute(stmt)
            role = psql.Identifier(app_role)
            for table in m.tenant_tables:
                t = psql.Identifier(table)
                conn.execute(psql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(t))
                # FORCE: the policies bind the table owner too, so no code path skips them by accident.
                conn.execute(psql.SQL("ALTER TABLE {} FORCE ROW LEVEL SECURITY").format(t))
                conn.execute(psql.SQL(
                    "CREATE POLICY tenant_isolation ON {} USING (tenant_id = current_setting('moorage.tenant_id', true)) "
                    "WITH CHECK (tenant_id = current_setting('moorage.tenant_id', true))"
                ).format(t))
                conn.execute(psql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(t, role))
            if tenant:
                conn.execute(psql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}").format(role))
            conn.execute(
                "INSERT INTO schema_migrations (component, version, name, applied_at) VALUES (%s, %s, %s, now())",
                (component, m.version, recorded_name(m)),
            )


def _begin(conn: psycopg.Connection, tenant_id: str) -> None:
    """Open a transaction scoped to one tenant (queued; the caller's pipeline sends it)."""
    conn.execute(b"BEGIN")
    # is_local=true: the setting dies with this transaction, so a pooled connection never
    # carries one tenant's identity into another's request.
    conn.execute("SELECT set_config('moorage.tenant_id', %s, true)", (tenant_id,))


def _begin_now(conn: psycopg.Connection, tenant_id: str) -> None:
    """``_begin`` sent now, in one round trip."""
    with conn.pipeline():
        _begin(conn, tenant_id)


def _rollback(conn: psycopg.Connection) -> None:
    """Undo an open or failed transaction; a broken connection is left for the pool to discard."""
    if conn.closed or conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        conn.execute(b"ROLLBACK")


class PostgresBackend(Backend):
    dialect = "postgres"

    def __init__(self, owner_url: str, app_role: str = "moorage_app", app_url: str | None = None,
                 pool_size: int = 10, upto: int | None = None) -> None:
        if not _ROLE.fullmatch(app_role):
            raise ConfigError(f"invalid application role name {app_role!r}")
        self.owner_url = owner_url
        self.app_role = app_role
        self.app_url = app_url or derive_app_url(owner_url, app_role)
        try:
            self._owner = self._connect_owner()
        except psycopg.OperationalError as e:
            raise UnavailableError(f"cannot connect to PostgreSQL: {str(e).strip()}", hint="check MOORAGE_STORE_URL and that the server runs") from e
        # One owner connection serves the whole control plane: its transactions must not interleave between
        # threads (psycopg: "transaction commit at the wrong nesting level"); re-entrant for nested use.
        self._owner_lock = threading.RLock()
        self.migrate(upto)
        # autocommit: tenant_tx issues BEGIN itself, so it can send BEGIN and the tenant setting in
        # one round trip (psycopg's implicit BEGIN would be a round trip of its own).
        # While the server is down a request waits CONNECT_WAIT_S for a connection, then is answered 503; the pool
        # stops retrying in the background after as long (its retries back off without bound: after a long outage
        # the next one could come a minute after the server is back), and the next request tries again at once.
        # A server gone silent (a partition) fails a statement within connect_defaults' TCP timeouts, as a lost
        # connection; a session this host leaves idle inside a transaction (frozen mid-way) the server ends.
        quiet_pool_warnings()  # its warnings of each failed attempt while the server is down: a few, not thousands
        self._pool = ConnectionPool(self.app_url, min_size=1, max_size=pool_size, open=False,
                                    kwargs={"autocommit": True, **connect_defaults(self.app_url)},
                                    timeout=CONNECT_WAIT_S, reconnect_timeout=CONNECT_WAIT_S)
        #: When a write was last refused as read-only (the server a standby), and when one last committed: between
        #: the two, each pooled connection is asked whether it takes writes before it is used, and one to the
        #: standby is replaced instead of failing a write each.
        self._read_only_at = 0.0
        self._wrote_at = 0.0
        self._calls = PreparedCalls()
        try:
            self._pool.open(wait=True, timeout=30)
        except Exception as e:
            raise UnavailableError(f"cannot connect to PostgreSQL as {app_role}: {e}",
                                   hint="set MOORAGE_STORE_APP_URL or a .pgpass entry for the application role") from e

    def _connect_owner(self) -> psycopg.Connection:
        return psycopg.connect(self.owner_url, autocommit=True, connect_timeout=int(CONNECT_WAIT_S),
                               **connect_defaults(self.owner_url))

    def _owner_conn(self) -> psycopg.Connection:
        """The owner connection (``_owner_lock`` held), connected again when the server closed it: after a restart,
        a failover or a terminated backend the control plane (heartbeats, the webhook outbox) carries on."""
        if stale(self._owner):
            with contextlib.suppress(Exception):
                self._owner.close()
            self._owner = self._connect_owner()
        return self._owner

    def _checked_out(self) -> psycopg.Connection:
        """A pooled connection known to be open: the ones the server closed while idle (all of them after a restart)
        are discarded here, and the pool replaces them, instead of failing the request that drew them."""
        for _ in range(self._pool.max_size + 1):
            conn = self._pool.getconn()
            if not stale(conn) and not (self._read_only_at > self._wrote_at and read_only(conn)):
                return conn
            conn.close()
            self._pool.putconn(conn)
        return self._pool.getconn()

    @contextlib.contextmanager
    def _pooled(self, begin: Callable[[psycopg.Connection], None] | None = None) -> Iterator[psycopg.Connection]:
        """A checked pooled connection, ``begin(conn)`` run on it first. When the server closed it under ``begin``
        (a terminated backend says so a moment after the terminate: after the check), nothing of the caller's has
        run yet, so ``begin`` runs once more on another connection; not after a server gone silent (see
        ``_read_twice``)."""
        with unreachable_as_503():
            conn = self._checked_out()
            for attempt in (1, 2) if begin is not None else ():
                t0 = time.monotonic()
                try:
                    begin(conn)  # type: ignore[misc]
                    break
                except BaseException as e:
                    conn.close()
                    self._pool.putconn(conn)
                    if attempt == 2 or not is_connection_lost(e) or time.monotonic() - t0 > CONNECT_WAIT_S:
                        raise
                    conn = self._checked_out()
        try:
            yield conn
        except StoreUnreachable as e:
            conn.close()  # lost, or read-only (a standby): the pool connects again, to the primary once there is one
            if isinstance(e.__cause__, psycopg.errors.ReadOnlySqlTransaction):
                self._read_only_at = time.monotonic()
            raise
        finally:
            self._pool.putconn(conn)

    @staticmethod
    def _read_twice(read: Callable[[], T]) -> T:
        """A read whose connection the server closed under it runs once more on another (nothing was changed);
        not after the wait for a connection ran out, which would only double the caller's wait, nor after a
        connection lost only once the TCP timeouts ran out (``connect_defaults``: a network partition, a server host
        gone): the pool's other connections wait on the same silent network, and the caller would wait twice."""
        t0 = time.monotonic()
        try:
            return read()
        except StoreUnreachable as e:
            if isinstance(e.__cause__, PoolTimeout) or time.monotonic() - t0 > CONNECT_WAIT_S:
                raise
            return read()

    def migrate(self, upto: int | None = None) -> None:
        """Bring the schema up to date. Concurrent openers (many processes at once) serialise on a lock."""
        c = self._owner
        c.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        try:
            self._migrate_locked(upto)
        finally:
            c.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))

    def _migrate_locked(self, upto: int | None) -> None:
        c = self._owner
        role = psql.Identifier(self.app_role)
        with c.transaction():
            c.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (component TEXT NOT NULL, version INTEGER NOT NULL, "
                "name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (component, version))"
            )
            if not c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (self.app_role,)).fetchone():
                c.execute(psql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE").format(role))
            c.execute(psql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
        _apply(c, "control", CONTROL_MIGRATIONS, False, self.app_role, None)
        with c.transaction():
            # Authentication is the one control-plane read the application may do, through a narrow
            # SECURITY DEFINER function: the app role has no privilege on the tenants/api_keys tables.
            c.execute(
                """CREATE OR REPLACE FUNCTION moorage_authenticate(h TEXT)
                   RETURNS TABLE(id TEXT, tenant_id TEXT, scopes TEXT, revoked_at DOUBLE PRECISION)
                   LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public AS
                   $$ SELECT id, tenant_id, scopes, revoked_at FROM api_keys WHERE key_hash = h $$"""
            )
            c.execute("REVOKE ALL ON FUNCTION moorage_authenticate(TEXT) FROM PUBLIC")
            c.execute(psql.SQL("GRANT EXECUTE ON FUNCTION moorage_authenticate(TEXT) TO {}").format(role))
        _apply(c, "tenant", TENANT_MIGRATIONS, True, self.app_role, upto)

    @contextlib.contextmanager
    def tenant_tx(self, tenant_id: str, *, write: bool = True, pipeline: bool = False) -> Iterator[Conn]:
        """One transaction with ``moorage.tenant_id`` set locally (``is_local=true``) for RLS.

        BEGIN and the setting travel in one round trip, and COMMIT is the last. With ``pipeline=True``
        the whole transaction runs in psycopg pipeline mode: statements are queued and sent with the
        COMMIT in one round trip, so a write transaction costs one round trip. In that mode results
        (and ``rowcount``) are only certain once the block has exited; fetching inside the block
        works but costs a round trip. Errors, integrity ones included, surface when the block exits.
        """
        check_tenant_id(tenant_id)
        with self._pooled(None if pipeline else functools.partial(_begin_now, tenant_id=tenant_id)) as conn, \
                unreachable_as_503():
            try:
                with translate_integrity(psycopg.errors.UniqueViolation), translate_contention(_CONTENTION):
                    if pipeline:
                        with conn.pipeline():
                            _begin(conn, tenant_id)
                            yield Conn(conn, "postgres")
                            conn.execute(b"COMMIT")
                    else:  # begun by _pooled
                        yield Conn(conn, "postgres")
                        conn.execute(b"COMMIT")
            except BaseException:
                if pipeline:
                    # psycopg may record a statement as prepared whose Parse the server skipped after the
                    # error aborted the pipeline; the next use of that name would fail ("prepared
                    # statement ... does not exist"). A closed connection is replaced by the pool.
                    conn.close()
                else:
                    _rollback(conn)
                raise
            if write:
                self._wrote_at = time.monotonic()  # the server takes writes (again)

    def tenant_call(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run one statement that scopes itself to ``tenant_id`` as its own autocommitted transaction.

        For functions such as ``moorage_lg_write`` that take the tenant as their first argument and set
        ``moorage.tenant_id`` locally before touching a table: ``sql`` gets ``tenant_id`` as its first
        parameter, then ``params``. One round trip; when this returns the transaction has committed
        (with the server's ``synchronous_commit``), and on error it has rolled back. The statement is
        prepared once per connection and the round trip runs inside libpq without the GIL (see
        ``pg_prepared``): the group commit's path for every checkpoint batch, and the saver's reads.
        """
        check_tenant_id(tenant_id)
        with self._pooled() as conn, unreachable_as_503():
            try:
                with translate_integrity(psycopg.errors.UniqueViolation), translate_contention(_CONTENTION):
                    return self._calls.run(conn, sql, (tenant_id, *params))
            except BaseException:
                _rollback(conn)
                raise

    def tenant_read(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        def read() -> list[tuple]:
            # BEGIN, the tenant setting, the statement and COMMIT leave in one pipelined round trip.
            with self.tenant_tx(tenant_id, write=False, pipeline=True) as c:
                cur = c.raw.execute(c._sql(sql), tuple(params))
            return cur.fetchall()  # the pipeline synced on exit; the rows are on the cursor

        return self._read_twice(read)

    @contextlib.contextmanager
    def control_tx(self) -> Iterator[Conn]:
        with self._owner_lock:
            try:
                with unreachable_as_503(), contextlib.ExitStack() as tx:
                    for attempt in (1, 2):  # BEGIN on a connection closed since the check: once more (see _pooled)
                        conn = self._owner_conn()
                        try:
                            tx.enter_context(conn.transaction())
                            break
                        except psycopg.OperationalError as e:
                            if attempt == 2 or not is_connection_lost(e):
                                raise
                            conn.close()  # connected again by _owner_conn
                    yield Conn(conn, "postgres")
            except StoreUnreachable:
                self._owner.close()  # lost, or read-only (a standby): connected again by the next call
                raise

    def authenticate_hash(self, key_hash: str) -> tuple[str, str, str, float | None] | None:
        def read() -> tuple | None:
            with self._pooled() as conn, unreachable_as_503():
                r = conn.execute("SELECT id, tenant_id, scopes, revoked_at FROM moorage_authenticate(%s)",
                                 (key_hash,)).fetchone()
                conn.rollback()
            return r

        r = self._read_twice(read)
        return None if r is None else (r[0], r[1], r[2], r[3])

    def init_tenant(self, tenant_id: str) -> None:
        check_tenant_id(tenant_id)

    def drop_tenant(self, tenant_id: str) -> None:
        check_tenant_id(tenant_id)
        from moorage.store.schema import TENANT_MIGRATIONS as TM

        tables = [t for m in TM for t in m.tenant_tables]
        with self.tenant_tx(tenant_id) as c:
            for t in tables:
                c.x(f"DELETE FROM {t}")

    def purge(self, tenant_id: str) -> None:
        # Dead tuples are invisible to every query at once and reclaimed by (auto)vacuum; VACUUM cannot run
        # inside the request's transaction, so it is left to autovacuum (see docs/decisions/0001).
        check_tenant_id(tenant_id)

    def schema_version(self, tenant_id: str | None = None) -> int:
        component = "control" if tenant_id is None else "tenant"
        with self._owner_lock, unreachable_as_503():
            r = self._owner_conn().execute(
                "SELECT COALESCE(MAX(version), 0) FROM schema_migrations WHERE component = %s", (component,)).fetchone()
        return int(r[0])

    def describe(self) -> str:
        with self._owner_lock, unreachable_as_503():
            c = self._owner_conn()
            v = c.execute("SHOW server_version").fetchone()[0]
            sync = c.execute("SHOW synchronous_commit").fetchone()[0]
            fsync = c.execute("SHOW fsync").fetchone()[0]
        return f"postgresql {v} (app role {self.app_role}, row-level security forced, synchronous_commit={sync}, fsync={fsync})"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.close()
        with contextlib.suppress(Exception):
            self._owner.close()
