"""Tenant isolation below the application: hand-written SQL as the app role, and per-tenant SQLite files."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from moorage.errors import TenantScopeError
from moorage.store import Principal, Scope, Store
from moorage.store.postgres import PostgresBackend, derive_app_url
from moorage.store.schema import TENANT_MIGRATIONS
from moorage.store.sqlite import SQLiteBackend

S = Scope.session("bot", "alice", "s1")
TENANT_TABLES = [t for m in TENANT_MIGRATIONS for t in m.tenant_tables]


def _two_tenants(store: Store) -> tuple[str, str]:
    ta, ka = store.operator.create_tenant("acme")
    tb, kb = store.operator.create_tenant("globex")
    a = store.tenant(store.authenticate(ka.secret))
    b = store.tenant(store.authenticate(kb.secret))
    a.state.put(S, "k", "acme-secret", expected_version=0)
    a.events.append(S, "message", "acme secret event")
    b.state.put(S, "k", "globex-secret", expected_version=0)
    return ta.id, tb.id


def test_postgres_rls_blocks_hand_written_sql(pg_url: str) -> None:
    store = Store(PostgresBackend(pg_url))
    a_id, b_id = _two_tenants(store)
    app = psycopg.connect(derive_app_url(pg_url, "moorage_app"))
    try:
        with app.transaction():
            app.execute("SELECT set_config('moorage.tenant_id', %s, true)", (a_id,))
            rows = app.execute("SELECT value FROM state").fetchall()
            assert rows == [('"acme-secret"',)]
            # Even naming the other tenant explicitly finds nothing.
            assert app.execute("SELECT count(*) FROM state WHERE tenant_id = %s", (b_id,)).fetchone()[0] == 0
            assert app.execute("UPDATE state SET value = '\"pwned\"' WHERE tenant_id = %s", (b_id,)).rowcount == 0
            assert app.execute("DELETE FROM events WHERE tenant_id = %s", (b_id,)).rowcount == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # WITH CHECK refuses a foreign tenant_id
            with app.transaction():
                app.execute("SELECT set_config('moorage.tenant_id', %s, true)", (a_id,))
                app.execute("INSERT INTO state (tenant_id, scope, key, value, version, updated_at) VALUES (%s, 'x', 'y', '1', 1, 0)", (b_id,))
        with app.transaction():  # no tenant set: every tenant table is empty
            for t in TENANT_TABLES:
                assert app.execute(f"SELECT count(*) FROM {t}").fetchone()[0] == 0, t
        for forbidden in ("SELECT * FROM api_keys", "SELECT * FROM tenants", "ALTER TABLE state DISABLE ROW LEVEL SECURITY",
                          "ALTER TABLE state NO FORCE ROW LEVEL SECURITY", "DROP POLICY tenant_isolation ON state"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                with app.transaction():
                    app.execute(forbidden)
        # Every tenant table has RLS enabled and forced.
        with app.transaction():
            rows = app.execute(
                "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class WHERE relname = ANY(%s)", (TENANT_TABLES,)
            ).fetchall()
        assert sorted(r[0] for r in rows) == sorted(TENANT_TABLES)
        assert all(r[1] and r[2] for r in rows)
    finally:
        app.close()
        store.close()
    # The other tenant's data is untouched.
    store = Store(PostgresBackend(pg_url))
    tb = store.tenant(store.operator.principal(b_id))
    assert tb.state.get(S, "k").value == "globex-secret"
    store.close()


def test_sqlite_tenant_handle_reaches_only_its_file(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "store")
    store = Store(backend)
    a_id, b_id = _two_tenants(store)
    files = sorted(p.name for p in (tmp_path / "store" / "tenants").glob("*.db"))
    assert files == sorted([f"{a_id}.db", f"{b_id}.db"])
    assert b"globex-secret" not in (tmp_path / "store" / "tenants" / f"{a_id}.db").read_bytes()
    for forged in ("../control", "..", f"{b_id}/../{a_id}", "0" * 32):
        with pytest.raises(TenantScopeError):
            store.tenant(Principal(forged)).state.get(S, "k")
    # No file was created for the forged ids.
    assert sorted(p.name for p in (tmp_path / "store" / "tenants").iterdir() if p.suffix == ".db") == files
    store.close()
