"""Versioned migrations upgrade an existing database in place, keeping its data."""

from __future__ import annotations

import json
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


def test_postgres_migration_6_keeps_pglz_values_readable(pg_url: str) -> None:
    """Values TOASTed with pglz at schema 5 still load after migration 6 (toast_tuple_target, lz4); new ones too."""
    import os

    from langgraph.checkpoint.base import empty_checkpoint

    from moorage.store.langgraph import MoorageSaver

    store = Store(PostgresBackend(pg_url, upto=5))
    t, _ = store.operator.create_tenant("old")
    ts = store.tenant(store.operator.principal(t.id))
    saver = MoorageSaver(ts)
    # Compressible (pglz shrinks it) and incompressible values, large enough to be TOASTed out of line.
    old = {"text": "abc" * 20000, "noise": os.urandom(30000).hex(), "small": 1}
    cp = empty_checkpoint()
    cp["channel_values"] = dict(old)
    cp["channel_versions"] = {k: 1 for k in old}
    cfg = saver.put({"configurable": {"thread_id": "v5", "checkpoint_ns": ""}}, cp, {"step": 0}, {k: 1 for k in old})
    saver.put_writes(cfg, [("text", "w" * 9000)], task_id="t1")
    store.close()

    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    with store2.backend._owner.cursor() as cur:  # type: ignore[attr-defined]
        opts = dict(cur.execute("SELECT relname, array_to_string(reloptions, ',') FROM pg_class WHERE relname IN "
                                "('lg_checkpoints', 'lg_blobs', 'lg_writes')").fetchall())
        lz4 = cur.execute("SELECT count(*) FROM pg_attribute WHERE attrelid IN ('lg_checkpoints'::regclass, "
                          "'lg_blobs'::regclass, 'lg_writes'::regclass) AND attcompression = 'l'").fetchone()[0]
    assert opts == {name: "toast_tuple_target=8160" for name in ("lg_checkpoints", "lg_blobs", "lg_writes")}
    assert lz4 in (0, 3)  # all three columns, or none where the server lacks lz4
    ts2 = store2.tenant(store2.operator.principal(t.id))
    saver2 = MoorageSaver(ts2)
    got = saver2.get_tuple(cfg)
    assert got is not None and got.checkpoint["channel_values"] == old
    assert got.pending_writes == [("t1", "text", "w" * 9000)]
    cp2 = empty_checkpoint()
    new = {"text": "xyz" * 20000, "noise": os.urandom(30000).hex(), "small": 2, "mid": os.urandom(3000).hex()}
    cp2["channel_values"] = dict(new)
    cp2["channel_versions"] = {k: 2 for k in new}
    cfg2 = saver2.put(cfg, cp2, {"step": 1}, {k: 2 for k in new})
    got2 = saver2.get_tuple(cfg2)
    assert got2 is not None and got2.checkpoint["channel_values"] == new
    assert saver2.get_tuple(cfg).checkpoint["channel_values"] == old  # type: ignore[union-attr]
    _checkpoint_round_trip(ts2)
    store2.close()


def _rows_written_before_migration_18_have_their_instance(store: Store, tenant_id: str) -> None:
    """Rows of two instances written at schema 17 name their instance after the upgrade, and the instance's
    checkpoints read by it: a deletion after the upgrade is seen by the next (incremental) checkpoint."""
    from moorage.store.repos.checkpoints import Checkpoints
    from tests.timetravel.test_checkpoint_image import _kinds, _stored, _whole
    from tests.timetravel.test_store_checkpoints import A, U

    ts = store.tenant(store.operator.principal(tenant_id))
    with ts.transaction():
        c = ts.ambient()
        for t in ("state", "facts", "workflow_runs", "steps", "journal"):
            got = sorted({r[0] for r in c.q(f"SELECT owner FROM {t}")})  # type: ignore[union-attr]
            assert got == [f"{A}/{U}", f"{A}/v"], (t, got)
    cps = Checkpoints(ts)
    cps.take(A, U)
    scope = Scope.for_user(A, U)
    ts.state.delete(scope, "counter", expected_version=ts.state.get(scope, "counter").version)  # type: ignore[union-attr]
    ck = cps.take(A, U)
    assert _kinds(ts)[-1] == "delta" and _stored(ts, ck.id) == _whole(ts)
    assert not any("counter" in k for k in _whole(ts)["state"]) and _whole(ts, "v")["state"]


def _turn(ts, n: int, user: str) -> None:  # type: ignore[no-untyped-def]
    """A turn's rows (tests.timetravel's turn) on a store at schema 17: its fact is written with that schema's
    columns (the facts repository of this version writes later ones too)."""
    from unittest import mock

    from moorage.memory.semantic import SemanticMemory
    from tests.timetravel.test_store_checkpoints import _turn as turn

    def record(self: SemanticMemory, scope: Scope, c, **_: object) -> None:  # type: ignore[no-untyped-def]
        with ts.transaction():
            ts.ambient().x(
                "INSERT INTO facts (id, scope, subject, attribute, value, text, valid_from, valid_to, recorded_at, "
                "superseded_at, superseded_by, trust, status, provenance, source, version) "
                "VALUES (?, ?, ?, ?, ?, ?, 1.0, NULL, 1.0, NULL, NULL, 'user_stated', 'active', '[]', 'user', 1)",
                (f"{user}-{n}", scope.key, c.subject, c.attribute, c.value, c.text))

    with mock.patch.object(SemanticMemory, "record", record):
        turn(ts, n, user)


def test_sqlite_rows_written_before_migration_18_get_their_instance(tmp_path: Path) -> None:
    from tests.timetravel.test_store_checkpoints import U

    b = SQLiteBackend(tmp_path / "store")
    tid = "b" * 32
    with b.control_tx() as c:
        c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (tid, "old", 0.0))
    b.init_tenant(tid, upto=17)
    b._migrated.add(str(b.tenant_path(tid)))
    store = Store(b)
    ts = store.tenant(store.operator.principal(tid))
    for user in (U, "v"):
        _turn(ts, 1, user)
    b.close()
    store2 = Store(SQLiteBackend(tmp_path / "store"))
    _rows_written_before_migration_18_have_their_instance(store2, tid)
    store2.close()


def test_postgres_rows_written_before_migration_18_get_their_instance(pg_url: str) -> None:
    from tests.timetravel.test_store_checkpoints import U

    store = Store(PostgresBackend(pg_url, upto=17))
    t, _ = store.operator.create_tenant("old18")
    other, _ = store.operator.create_tenant("other18")  # another tenant's rows are backfilled too, apart
    for tid in (t.id, other.id):
        ts = store.tenant(store.operator.principal(tid))
        for user in (U, "v"):
            _turn(ts, 1, user)
    store.close()
    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    for tid in (t.id, other.id):
        _rows_written_before_migration_18_have_their_instance(store2, tid)
    store2.close()


def test_sqlite_store_migrated_by_a_newer_moorage_is_refused_untouched(tmp_path: Path) -> None:
    """Going back to an older moorage after an upgrade (docs/operations.md): it refuses the newer schema, naming
    what to do, instead of running on it."""
    import sqlite3

    import pytest

    from moorage.errors import ConfigError

    store = Store(SQLiteBackend(tmp_path / "store"))
    t, _ = store.operator.create_tenant("newer")
    store.close()
    for db in (tmp_path / "store" / "control.db", SQLiteBackend(tmp_path / "store").tenant_path(t.id)):
        with sqlite3.connect(db) as c:  # what a newer moorage's next migration leaves
            c.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (10_000, "from the future", 0.0))
        with pytest.raises(ConfigError, match="newer than this moorage knows") as e:
            again = Store(SQLiteBackend(tmp_path / "store"))
            again.tenant(again.operator.principal(t.id)).events.list(S)
        assert "restore the copy" in (e.value.hint or "")
        with sqlite3.connect(db) as c:
            c.execute("DELETE FROM schema_migrations WHERE version = 10000")


def test_postgres_store_migrated_by_a_newer_moorage_is_refused(pg_url: str) -> None:
    import psycopg
    import pytest

    from moorage.errors import ConfigError

    PostgresBackend(pg_url).close()  # migrated to this moorage's latest
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("INSERT INTO schema_migrations VALUES ('tenant', 10000, 'from the future', now())")
    try:
        with pytest.raises(ConfigError, match="newer than this moorage knows"):
            PostgresBackend(pg_url)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as c:
            c.execute("DELETE FROM schema_migrations WHERE version = 10000")


def _write_v19_pending_fact(store: Store, tenant_id: str) -> None:
    # Written with the columns of schema 19 (no confirmed_at yet), as the facts repository of that version did.
    with store.backend.tenant_tx(tenant_id) as c:
        c.x("INSERT INTO facts (id, scope, subject, attribute, value, text, valid_from, valid_to, recorded_at, "
            "superseded_at, superseded_by, trust, status, provenance, source, version, value_key) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, NULL, NULL, ?, ?, ?, ?, 1, ?)",
            ("f19", Scope.for_user("bot", "alice").key, "user", "city", "Porto", "lives in Porto", 1.0, 1.0,
             "model_inferred", "pending", "[]", "agent", "porto"))


def _pending_fact_from_v19_is_listed_and_confirmed(store: Store, tenant_id: str) -> None:
    import time

    from moorage.memory import SemanticMemory

    ts = store.tenant(store.operator.principal(tenant_id))
    scope = Scope.for_user("bot", "alice")
    [waiting] = ts.facts.waiting(scope)
    assert waiting.id == "f19" and waiting.confirmed_at is None
    before = time.time()
    done = SemanticMemory(ts).confirm(scope, "f19")
    assert done.fact.confirmed_at is not None and done.fact.confirmed_at >= before
    assert ts.facts.waiting(scope) == [] and ts.facts.get("f19").confirmed_at == done.fact.confirmed_at
    assert [f.value for f in ts.facts.list(scope, known_at=before - 0.001)] == []


def test_sqlite_pending_facts_written_before_migration_20_are_confirmed_with_their_time(tmp_path: Path) -> None:
    b = SQLiteBackend(tmp_path / "store")
    tid = "c" * 32
    with b.control_tx() as c:
        c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (tid, "old", 0.0))
    b.init_tenant(tid, upto=19)
    b._migrated.add(str(b.tenant_path(tid)))
    _write_v19_pending_fact(Store(b), tid)
    b.close()
    store = Store(SQLiteBackend(tmp_path / "store"))
    _pending_fact_from_v19_is_listed_and_confirmed(store, tid)
    assert store.backend.schema_version(tid) == LATEST_TENANT_VERSION
    store.close()


def test_postgres_pending_facts_written_before_migration_20_are_confirmed_with_their_time(pg_url: str) -> None:
    store = Store(PostgresBackend(pg_url, upto=19))
    t, _ = store.operator.create_tenant("old20")
    _write_v19_pending_fact(store, t.id)
    store.close()
    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    _pending_fact_from_v19_is_listed_and_confirmed(store2, t.id)
    store2.close()


def _write_v20_spans(store: Store, tenant_id: str) -> None:
    # Request spans as schema 20 held them: the user and agent only in the JSON attributes.
    with store.backend.tenant_tx(tenant_id) as c:
        for span_id, attrs in [("gus-pal", '{"moorage.agent": "pal", "moorage.user": "gus"}'),
                               ("gus-any", '{"moorage.user": "gus"}'), ("ida", '{"moorage.user": "ida"}'),
                               ("gus-other", '{"moorage.agent": "other", "moorage.user": "gus"}'),
                               ("odd", '{"moorage.user": 7}'), ("nobody", "{}")]:
            c.x("INSERT INTO spans (trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, scope) "
                "VALUES (?, ?, NULL, 'GET /v1/x', 1.0, 2.0, 'ok', ?, NULL)", ("t", span_id, attrs))


def _spans_from_v20_are_forgotten(store: Store, tenant_id: str) -> None:
    ts = store.tenant(store.operator.principal(tenant_id))
    assert ts.spans.forget_user("gus", "pal") == 2
    assert sorted(r[0] for r in ts.read("SELECT span_id FROM spans")) == ["gus-other", "ida", "nobody", "odd"]
    assert ts.spans.forget_user("gus") == 1


def test_sqlite_request_spans_written_before_migration_21_are_forgotten(tmp_path: Path) -> None:
    b = SQLiteBackend(tmp_path / "store")
    tid = "d" * 32
    with b.control_tx() as c:
        c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (tid, "old", 0.0))
    b.init_tenant(tid, upto=20)
    b._migrated.add(str(b.tenant_path(tid)))
    _write_v20_spans(Store(b), tid)
    b.close()
    store = Store(SQLiteBackend(tmp_path / "store"))
    _spans_from_v20_are_forgotten(store, tid)
    store.close()


def test_postgres_request_spans_written_before_migration_21_are_forgotten(pg_url: str) -> None:
    store = Store(PostgresBackend(pg_url, upto=20))
    t, _ = store.operator.create_tenant("old21")
    other, _ = store.operator.create_tenant("other21")  # every tenant's spans are filled in, each apart
    for tid in (t.id, other.id):
        _write_v20_spans(store, tid)
    store.close()
    store2 = Store(PostgresBackend(pg_url))
    assert store2.backend.schema_version("any") == LATEST_TENANT_VERSION
    for tid in (t.id, other.id):
        _spans_from_v20_are_forgotten(store2, tid)
    store2.close()


def _write_v24_deliveries(store: Store, tenant_id: str) -> None:
    """Deliveries as a version before 25 wrote them: the user only in the payload."""
    with store.backend.tenant_tx(tenant_id) as c:
        for did, user, agent in (("d-gus", "gus", "pal"), ("d-gus-other", "gus", "other"), ("d-ida", "ida", "pal"),
                                 ("d-none", None, "pal")):
            data = {"agent": agent, **({"user": user} if user else {}), "reply": f"about {user}"}
            c.x("INSERT INTO webhook_deliveries (id, webhook_id, event, payload, status, attempts, next_at, created_at, "
                "updated_at, version) VALUES (?, 'wh', 'execution.succeeded', ?, 'delivered', 1, NULL, 1.0, 1.0, 1)",
                (did, json.dumps({"type": "execution.succeeded", "timestamp": 1.0, "data": data})))


def _deliveries_from_v24_are_forgotten(store: Store, tenant_id: str) -> None:
    ts = store.tenant(store.operator.principal(tenant_id))
    ts.forget_user("gus", "pal")
    assert sorted(r[0] for r in ts.read("SELECT id FROM webhook_deliveries")) == ["d-gus-other", "d-ida", "d-none"]
    ts.forget_user("gus")
    assert sorted(r[0] for r in ts.read("SELECT id FROM webhook_deliveries")) == ["d-ida", "d-none"]


def test_sqlite_webhook_deliveries_written_before_migration_25_are_forgotten(tmp_path: Path) -> None:
    b = SQLiteBackend(tmp_path / "store")
    tid = "e" * 32
    with b.control_tx() as c:
        c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (tid, "old", 0.0))
    b.init_tenant(tid, upto=24)
    b._migrated.add(str(b.tenant_path(tid)))
    _write_v24_deliveries(Store(b), tid)
    b.close()
    store = Store(SQLiteBackend(tmp_path / "store"))
    _deliveries_from_v24_are_forgotten(store, tid)
    store.close()


def test_postgres_webhook_deliveries_written_before_migration_25_are_forgotten(pg_url: str) -> None:
    store = Store(PostgresBackend(pg_url, upto=24))
    t, _ = store.operator.create_tenant("old25")
    other, _ = store.operator.create_tenant("other25")
    for tid in (t.id, other.id):
        _write_v24_deliveries(store, tid)
    store.close()
    store2 = Store(PostgresBackend(pg_url))
    _deliveries_from_v24_are_forgotten(store2, t.id)
    # A host of an earlier version, during a rolling upgrade, writes a delivery without the column: filled in.
    with store2.backend.tenant_tx(other.id) as c:
        c.x("INSERT INTO webhook_deliveries (id, webhook_id, event, payload, status, attempts, next_at, created_at, "
            "updated_at, version) VALUES ('d-late', 'wh', 'fact.pending', ?, 'pending', 0, 1.0, 2.0, 2.0, 1)",
            (json.dumps({"type": "fact.pending", "timestamp": 2.0, "data": {"agent": "pal", "user": "gus"}}),))
    _deliveries_from_v24_are_forgotten(store2, other.id)
    store2.close()
