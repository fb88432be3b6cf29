"""Versioned migrations upgrade an existing database in place, keeping its data."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Scope, Store
from moorage.store.postgres import PostgresBackend
from moorage.store.schema import LATEST_TENANT_VERSION
from moorage.store.sqlite import SQLiteBackend

S = Scope.session("bot", "alice", "s1")


def _write_v1_data(store: Store, tenant_id: str) -> None:
    # At version 1 there is no full-text index yet; write through the raw connection of that schema.
    with store.backend.tenant_tx(tenant_id) as c:
        c.x("INSERT INTO events (scope, ts, kind, speaker, content, meta) VALUES (?, ?, ?, ?, ?, ?)",
            (S.key, 1.0, "message", "alice", "the quick brown fox jumps", "{}"))


def test_sqlite_upgrades_a_v1_database(tmp_path: Path) -> None:
    b = SQLiteBackend(tmp_path / "store")
    store = Store(b)
    # Build a tenant at schema version 1 only (create_tenant would migrate it to the latest).
    with b.control_tx() as c:
        c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", ("a" * 32, "old", 0.0))
    b.init_tenant("a" * 32, upto=1)
    assert b.schema_version("a" * 32) == 1
    b._migrated.add(str(b.tenant_path("a" * 32)))  # pretend this process already checked it
    _write_v1_data(store, "a" * 32)
    b.close()

    b2 = SQLiteBackend(tmp_path / "store")  # a new process opens the old database
    store2 = Store(b2)
    ts = store2.tenant(store2.operator.principal("a" * 32))
    hits = ts.events.search_text(S, "fox")
    assert [e.content for e, _ in hits] == ["the quick brown fox jumps"]
    assert b2.schema_version("a" * 32) == LATEST_TENANT_VERSION
    _checkpoint_round_trip(ts)
    store2.close()


def test_postgres_upgrades_a_v1_database(pg_url: str) -> None:
    b = PostgresBackend(pg_url, upto=1)
    assert b.schema_version("any") == 1
    store = Store(b)
    t, _ = store.operator.create_tenant("old")
    _write_v1_data(store, t.id)
    store.close()

    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    ts = store2.tenant(store2.operator.principal(t.id))
    hits = ts.events.search_text(S, "fox")
    assert [e.content for e, _ in hits] == ["the quick brown fox jumps"]
    _checkpoint_round_trip(ts)
    store2.close()


def _checkpoint_round_trip(ts) -> None:  # type: ignore[no-untyped-def]
    """The upgraded database takes checkpoints (on PostgreSQL through moorage_lg_write, migration 5)."""
    from langgraph.checkpoint.base import empty_checkpoint

    from moorage.store.langgraph import MoorageSaver

    saver = MoorageSaver(ts)
    cp = empty_checkpoint()
    cp["channel_values"] = {"v": "x", "big": "y" * 10000}
    cp["channel_versions"] = {"v": 1, "big": 1}
    cfg = saver.put({"configurable": {"thread_id": "m", "checkpoint_ns": ""}}, cp, {}, {"v": 1, "big": 1})
    saver.put_writes(cfg, [("v", "w")], task_id="t1")
    got = saver.get_tuple(cfg)
    assert got is not None and got.checkpoint["channel_values"] == {"v": "x", "big": "y" * 10000}
    assert got.pending_writes == [("t1", "v", "w")]


def test_postgres_checkpoints_from_v4_read_after_the_upgrade(pg_url: str) -> None:
    """Checkpoints written at schema 4 (every value in lg_blobs, no moorage_lg_write) load after migration 5."""
    from langgraph.checkpoint.base import empty_checkpoint

    from moorage.store.langgraph import MoorageSaver

    store = Store(PostgresBackend(pg_url, upto=4))
    t, _ = store.operator.create_tenant("old")
    ts = store.tenant(store.operator.principal(t.id))
    saver = MoorageSaver(ts, inline_max=0)
    cp = empty_checkpoint()
    cp["channel_values"] = {"v": "old", "n": 3}
    cp["channel_versions"] = {"v": 1, "n": 1}
    with ts.transaction():  # joins the caller's transaction: plain statements, no migration-5 function
        cfg = saver.put({"configurable": {"thread_id": "v4", "checkpoint_ns": ""}}, cp, {"step": 0}, {"v": 1, "n": 1})
    store.close()

    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    ts2 = store2.tenant(store2.operator.principal(t.id))
    got = MoorageSaver(ts2).get_tuple(cfg)
    assert got is not None and got.checkpoint["channel_values"] == {"v": "old", "n": 3}
    _checkpoint_round_trip(ts2)
    store2.close()
