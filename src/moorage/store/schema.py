"""The store's schema as an ordered list of versioned migrations, rendered per SQL dialect.

Every database records the versions applied to it in ``schema_migrations``; opening a store applies
the missing ones in place. Tenant tables get a ``tenant_id`` column and forced row-level security on
PostgreSQL; on SQLite each tenant has its own database file, so the column is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moorage.errors import ConfigError
from moorage.store import usage_rollups


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    #: Statements in the portable template language below.
    statements: tuple[str, ...]
    #: Tables created by this migration that hold tenant data (RLS on PostgreSQL).
    tenant_tables: tuple[str, ...] = ()
    sqlite_only: tuple[str, ...] = ()
    postgres_only: tuple[str, ...] = ()
    #: Rows to re-index or backfill after the statements ran, same template language.
    after: tuple[str, ...] = field(default=())
    #: Whether a moorage that knows only the migrations before this one may go on serving a store it was applied to:
    #: it adds only what older code neither reads nor must keep up (an index; a table or trigger the store keeps
    #: itself). Recorded with it (``recorded_name``), so that in a rolling upgrade of a fleet a host not upgraded
    #: yet still starts on the store the first upgraded host migrated (``refuse_newer_schema``).
    older_may_serve: bool = False


# Migration 9's read of one checkpoint (PostgreSQL): the checkpoint row...
_LG_GET_CP = ("SELECT k.thread_id, k.checkpoint_ns, k.checkpoint_id, k.parent_id, k.type, k.checkpoint, k.metadata, "
              "k.versions FROM lg_checkpoints k WHERE k.thread_id = p_thread AND k.checkpoint_ns = p_ns")
# ...then its rows, as langgraph_sql.Statements documents them (SQLite reads the same rows with one query).
# Blobs join through the version map (migration 4); a LATERAL subquery with LIMIT 1 is not flattened, so each
# (channel, version) is one primary-key probe (a plain join was reordered to hash every blob of the thread).
_LG_GET_ROWS = (
    "SELECT 0, cp.checkpoint_id, cp.parent_id, cp.metadata, cp.type, cp.checkpoint, NULL::INTEGER, cp.versions FROM cp "
    "UNION ALL "
    "SELECT 1, b.channel, NULL, NULL, b.type, b.blob, NULL, NULL FROM cp "
    "CROSS JOIN LATERAL jsonb_each_text(cp.versions::jsonb) AS j "
    "CROSS JOIN LATERAL (SELECT x.channel, x.type, x.blob FROM lg_blobs x WHERE x.thread_id = cp.thread_id "
    "AND x.checkpoint_ns = cp.checkpoint_ns AND x.channel = j.key AND x.version = j.value LIMIT 1) AS b "
    "UNION ALL "
    "SELECT 2, w.task_id, w.channel, w.task_path, w.type, w.blob, w.idx, NULL FROM cp "
    "JOIN lg_writes w ON w.thread_id = cp.thread_id AND w.checkpoint_ns = cp.checkpoint_ns "
    "AND w.checkpoint_id = cp.checkpoint_id")

# The tables whose rows agent checkpoints image (store/repos/checkpoint_image.py IMAGED).
_IMAGED = ("state", "facts", "workflow_runs", "steps", "journal", "sessions")

# Migration 18: the instance ("agent/user") a row of an imaged table belongs to, from its scope key
# (``user:a/u``, ``session:a/u/s``, ``workflow:a/u/r``; other scopes belong to no instance).
def _owner_of_scope_sqlite(col: str) -> str:
    def two(r: str) -> str:  # "a/u/x" -> "a/u" (NULL when there is no second "/")
        return (f"CASE WHEN instr(substr({r}, instr({r}, '/') + 1), '/') > 0 THEN "
                f"substr({r}, 1, instr({r}, '/') + instr(substr({r}, instr({r}, '/') + 1), '/') - 1) END")
    return (f"(CASE WHEN substr({col}, 1, 5) = 'user:' THEN substr({col}, 6) "
            f"WHEN substr({col}, 1, 8) = 'session:' THEN {two(f'substr({col}, 9)')} "
            f"WHEN substr({col}, 1, 9) = 'workflow:' THEN {two(f'substr({col}, 10)')} END)")


def _owner_of_scope_postgres(col: str) -> str:
    def two(r: str) -> str:
        return f"NULLIF(split_part({r}, '/', 1) || '/' || split_part({r}, '/', 2), split_part({r}, '/', 1) || '/')"
    return (f"(CASE WHEN left({col}, 5) = 'user:' THEN substr({col}, 6) "
            f"WHEN left({col}, 8) = 'session:' THEN {two(f'substr({col}, 9)')} "
            f"WHEN left({col}, 9) = 'workflow:' THEN {two(f'substr({col}, 10)')} END)")


def _owner_sqlite(t: str, row: str) -> str:
    """The owner of row ``row`` (NEW, OLD or the table itself) of imaged table ``t``, in SQLite."""
    run = f"(SELECT w.owner FROM workflow_runs w WHERE w.id = {row}.run_id)"
    if t == "sessions":
        return f"{row}.agent_id || '/' || {row}.user_id"
    if t == "steps":
        return run
    if t == "journal":
        return f"COALESCE({_owner_of_scope_sqlite(row + '.scope')}, {run})"
    return _owner_of_scope_sqlite(f"{row}.scope")


# Primary keys of the imaged tables (checkpoint_image.IMAGED), as a deletion records them.
_IMAGED_PK = {"state": ("scope", "key"), "facts": ("id",), "workflow_runs": ("id",), "steps": ("run_id", "seq"),
              "journal": ("key",), "sessions": ("agent_id", "user_id", "id")}


# Only instances with a checkpoint to read from need their deletions (a primary-key probe of the head).
_HAS_HEAD_SQLITE = ("EXISTS (SELECT 1 FROM checkpoint_heads h WHERE h.agent_id = substr(OLD.owner, 1, "
                    "instr(OLD.owner, '/') - 1) AND h.user_id = substr(OLD.owner, instr(OLD.owner, '/') + 1) "
                    "AND h.row_mark IS NOT NULL)")


def _gone_sqlite(t: str) -> str:
    ks = [f"CAST(OLD.{k} AS TEXT)" for k in _IMAGED_PK[t]] + ["NULL"] * (3 - len(_IMAGED_PK[t]))
    return (f"CREATE TRIGGER {t}_gone AFTER DELETE ON {t} WHEN OLD.owner IS NOT NULL AND {_HAS_HEAD_SQLITE} BEGIN "
            f"INSERT INTO row_deletions (owner, tbl, k1, k2, k3, rv) VALUES (OLD.owner, '{t}', {', '.join(ks)}, "
            "(SELECT n FROM row_clock WHERE id = 1)); END")


# Template placeholders:
#   {tenant_col}  tenant_id column (PostgreSQL) or nothing (SQLite: one file per tenant)
#   {tpk}         "tenant_id, " inside primary/unique keys on PostgreSQL, "" on SQLite
#   {blob} {real} {autoid} {json}
TENANT_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "initial schema",
        statements=(
            """CREATE TABLE agents (
                {tenant_col}
                id TEXT NOT NULL, name TEXT NOT NULL, config {json} NOT NULL,
                live_deployment TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL,
                version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id), UNIQUE ({tpk}name))""",
            """CREATE TABLE deployments (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, number INTEGER NOT NULL,
                manifest {json} NOT NULL, package_ref TEXT NOT NULL, package_sha256 TEXT NOT NULL,
                status TEXT NOT NULL, created_at {real} NOT NULL,
                PRIMARY KEY ({tpk}id), UNIQUE ({tpk}agent_id, number))""",
            """CREATE TABLE end_users (
                {tenant_col}
                id TEXT NOT NULL, created_at {real} NOT NULL, meta {json} NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            """CREATE TABLE sessions (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, user_id TEXT NOT NULL,
                created_at {real} NOT NULL, last_active {real} NOT NULL, meta {json} NOT NULL,
                version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}agent_id, user_id, id))""",
            # Registry of every scope that holds data: drives retention and forgetting.
            """CREATE TABLE scopes (
                {tenant_col}
                scope TEXT NOT NULL, kind TEXT NOT NULL, agent_id TEXT NOT NULL, user_id TEXT,
                ref TEXT, created_at {real} NOT NULL, last_active {real} NOT NULL, expires_at {real},
                PRIMARY KEY ({tpk}scope))""",
            "CREATE INDEX scopes_expiry ON scopes (expires_at)",
            "CREATE INDEX scopes_user ON scopes (agent_id, user_id)",
            """CREATE TABLE retention (
                {tenant_col}
                kind TEXT NOT NULL, ttl_s {real},
                PRIMARY KEY ({tpk}kind))""",
            """CREATE TABLE state (
                {tenant_col}
                scope TEXT NOT NULL, key TEXT NOT NULL, value {json} NOT NULL,
                version INTEGER NOT NULL, updated_at {real} NOT NULL,
                PRIMARY KEY ({tpk}scope, key))""",
            """CREATE TABLE events (
                {tenant_col}
                id {autoid}, scope TEXT NOT NULL, ts {real} NOT NULL, kind TEXT NOT NULL,
                speaker TEXT, content TEXT NOT NULL, meta {json} NOT NULL, embedding {blob})""",
            "CREATE INDEX events_scope_ts ON events (scope, ts, id)",
            """CREATE TABLE facts (
                {tenant_col}
                id TEXT NOT NULL, scope TEXT NOT NULL, subject TEXT NOT NULL, attribute TEXT NOT NULL,
                value TEXT NOT NULL, text TEXT NOT NULL, valid_from {real} NOT NULL, valid_to {real},
                recorded_at {real} NOT NULL, superseded_at {real}, superseded_by TEXT,
                trust TEXT NOT NULL, status TEXT NOT NULL, provenance {json} NOT NULL,
                source TEXT NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            "CREATE INDEX facts_lookup ON facts (scope, subject, attribute, valid_from)",
            """CREATE TABLE workflow_runs (
                {tenant_col}
                id TEXT NOT NULL, scope TEXT NOT NULL, name TEXT NOT NULL, status TEXT NOT NULL,
                input {json} NOT NULL, state {json} NOT NULL, current_step TEXT, result {json},
                error TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            "CREATE INDEX workflow_runs_status ON workflow_runs (status, updated_at)",
            """CREATE TABLE steps (
                {tenant_col}
                run_id TEXT NOT NULL, seq INTEGER NOT NULL, name TEXT NOT NULL, status TEXT NOT NULL,
                attempts INTEGER NOT NULL, result {json}, error TEXT,
                started_at {real} NOT NULL, finished_at {real},
                PRIMARY KEY ({tpk}run_id, seq))""",
            """CREATE TABLE journal (
                {tenant_col}
                key TEXT NOT NULL, scope TEXT, run_id TEXT, step TEXT, status TEXT NOT NULL,
                result {json}, error TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL,
                version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}key))""",
            """CREATE TABLE sandboxes (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, scope TEXT NOT NULL, state TEXT NOT NULL,
                host TEXT, snapshot_ref TEXT, disk_ref TEXT, template_ref TEXT,
                last_active {real} NOT NULL, ttl_s {real}, meta {json} NOT NULL,
                created_at {real} NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id), UNIQUE ({tpk}scope))""",
            "CREATE INDEX sandboxes_state ON sandboxes (state, last_active)",
            """CREATE TABLE spans (
                {tenant_col}
                span_id TEXT NOT NULL, trace_id TEXT NOT NULL, parent_id TEXT, name TEXT NOT NULL,
                start_ts {real} NOT NULL, end_ts {real}, status TEXT NOT NULL, attrs {json} NOT NULL,
                scope TEXT,
                PRIMARY KEY ({tpk}span_id))""",
            "CREATE INDEX spans_trace ON spans (trace_id, start_ts)",
            """CREATE TABLE usage (
                {tenant_col}
                id {autoid}, ts {real} NOT NULL, kind TEXT NOT NULL, amount {real} NOT NULL,
                agent_id TEXT, user_id TEXT, scope TEXT, meta {json} NOT NULL)""",
            "CREATE INDEX usage_ts ON usage (ts)",
        ),
        tenant_tables=(
            "agents", "deployments", "end_users", "sessions", "scopes", "retention", "state", "events",
            "facts", "workflow_runs", "steps", "journal", "sandboxes", "spans", "usage",
        ),
    ),
    Migration(
        2,
        "full-text index over episodic events",
        statements=(),
        sqlite_only=(
            """CREATE VIRTUAL TABLE events_fts USING fts5(
                content, content='events', content_rowid='id', tokenize='porter unicode61')""",
            """CREATE TRIGGER events_fts_ai AFTER INSERT ON events BEGIN
                INSERT INTO events_fts(rowid, content) VALUES (new.id, new.content); END""",
            """CREATE TRIGGER events_fts_ad AFTER DELETE ON events BEGIN
                INSERT INTO events_fts(events_fts, rowid, content) VALUES ('delete', old.id, old.content); END""",
            """CREATE TRIGGER events_fts_au AFTER UPDATE OF content ON events BEGIN
                INSERT INTO events_fts(events_fts, rowid, content) VALUES ('delete', old.id, old.content);
                INSERT INTO events_fts(rowid, content) VALUES (new.id, new.content); END""",
            # Index what was written before this version existed.
            "INSERT INTO events_fts(events_fts) VALUES ('rebuild')",
        ),
        postgres_only=(
            "ALTER TABLE events ADD COLUMN tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', content)) STORED",
            "CREATE INDEX events_tsv ON events USING GIN (tsv)",
        ),
    ),
    Migration(
        3,
        "langgraph checkpoints",
        statements=(
            # One row per LangGraph checkpoint; channel values live in lg_blobs, keyed by the
            # channel's version, so a step that changes one channel writes one blob, not the state.
            """CREATE TABLE lg_checkpoints (
                {tenant_col}
                thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
                parent_id TEXT, run_id TEXT, type TEXT NOT NULL, checkpoint {blob} NOT NULL,
                metadata {json} NOT NULL,
                PRIMARY KEY ({tpk}thread_id, checkpoint_ns, checkpoint_id))""",
            "CREATE INDEX lg_checkpoints_run ON lg_checkpoints (run_id)",
            """CREATE TABLE lg_blobs (
                {tenant_col}
                thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, channel TEXT NOT NULL,
                version TEXT NOT NULL, type TEXT NOT NULL, blob {blob},
                PRIMARY KEY ({tpk}thread_id, checkpoint_ns, channel, version))""",
            """CREATE TABLE lg_writes (
                {tenant_col}
                thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
                task_id TEXT NOT NULL, idx INTEGER NOT NULL, channel TEXT NOT NULL, type TEXT NOT NULL,
                blob {blob} NOT NULL, task_path TEXT NOT NULL,
                PRIMARY KEY ({tpk}thread_id, checkpoint_ns, checkpoint_id, task_id, idx))""",
        ),
        tenant_tables=("lg_checkpoints", "lg_blobs", "lg_writes"),
    ),
    Migration(
        4,
        "langgraph checkpoint channel versions",
        statements=(
            # The checkpoint's channel -> version map as JSON (versions as strings, as lg_blobs keys
            # them), so one statement can join a checkpoint to its blobs without decoding the
            # serialised checkpoint first. NULL on rows written before this version: readers fall
            # back to decoding the checkpoint.
            "ALTER TABLE lg_checkpoints ADD COLUMN versions {json}",
        ),
    ),
    Migration(
        5,
        "langgraph batched checkpoint writes",
        statements=(),
        # PostgreSQL: one function applies a whole group-committed batch (checkpoints, channel blobs,
        # pending writes; one array per column) as a single autocommitted statement: one round trip and
        # one cached plan per table instead of BEGIN, the tenant setting, the inserts and COMMIT. It runs
        # with the caller's rights (SECURITY INVOKER), so forced row-level security applies to every row
        # exactly as in any other transaction: it sets moorage.tenant_id locally (is_local=true) first,
        # from the tenant the caller's TenantStore was authenticated for. SQLite needs nothing here.
        postgres_only=(
            """CREATE OR REPLACE FUNCTION moorage_lg_write(
                tenant TEXT,
                c_thread TEXT[] DEFAULT NULL, c_ns TEXT[] DEFAULT NULL, c_id TEXT[] DEFAULT NULL,
                c_parent TEXT[] DEFAULT NULL, c_run TEXT[] DEFAULT NULL, c_type TEXT[] DEFAULT NULL,
                c_blob BYTEA[] DEFAULT NULL, c_meta TEXT[] DEFAULT NULL, c_versions TEXT[] DEFAULT NULL,
                b_thread TEXT[] DEFAULT NULL, b_ns TEXT[] DEFAULT NULL, b_channel TEXT[] DEFAULT NULL,
                b_version TEXT[] DEFAULT NULL, b_type TEXT[] DEFAULT NULL, b_blob BYTEA[] DEFAULT NULL,
                w_thread TEXT[] DEFAULT NULL, w_ns TEXT[] DEFAULT NULL, w_id TEXT[] DEFAULT NULL,
                w_task TEXT[] DEFAULT NULL, w_idx INTEGER[] DEFAULT NULL, w_channel TEXT[] DEFAULT NULL,
                w_type TEXT[] DEFAULT NULL, w_blob BYTEA[] DEFAULT NULL, w_path TEXT[] DEFAULT NULL,
                u_thread TEXT[] DEFAULT NULL, u_ns TEXT[] DEFAULT NULL, u_id TEXT[] DEFAULT NULL,
                u_task TEXT[] DEFAULT NULL, u_idx INTEGER[] DEFAULT NULL, u_channel TEXT[] DEFAULT NULL,
                u_type TEXT[] DEFAULT NULL, u_blob BYTEA[] DEFAULT NULL, u_path TEXT[] DEFAULT NULL)
            RETURNS void LANGUAGE plpgsql SECURITY INVOKER AS $$
            BEGIN
                IF tenant IS NULL OR tenant = '' THEN
                    RAISE EXCEPTION 'moorage_lg_write needs a tenant';
                END IF;
                PERFORM set_config('moorage.tenant_id', tenant, true);
                IF b_thread IS NOT NULL THEN
                    INSERT INTO lg_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
                    SELECT * FROM unnest(b_thread, b_ns, b_channel, b_version, b_type, b_blob)
                    ON CONFLICT DO NOTHING;
                END IF;
                IF c_thread IS NOT NULL THEN
                    INSERT INTO lg_checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_id, run_id, type,
                                                checkpoint, metadata, versions)
                    SELECT * FROM unnest(c_thread, c_ns, c_id, c_parent, c_run, c_type, c_blob, c_meta, c_versions)
                    ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET
                        parent_id = excluded.parent_id, run_id = excluded.run_id, type = excluded.type,
                        checkpoint = excluded.checkpoint, metadata = excluded.metadata, versions = excluded.versions;
                END IF;
                IF w_thread IS NOT NULL THEN
                    INSERT INTO lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob,
                                           task_path)
                    SELECT * FROM unnest(w_thread, w_ns, w_id, w_task, w_idx, w_channel, w_type, w_blob, w_path)
                    ON CONFLICT DO NOTHING;
                END IF;
                IF u_thread IS NOT NULL THEN
                    INSERT INTO lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob,
                                           task_path)
                    SELECT * FROM unnest(u_thread, u_ns, u_id, u_task, u_idx, u_channel, u_type, u_blob, u_path)
                    ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx) DO UPDATE SET
                        channel = excluded.channel, type = excluded.type, blob = excluded.blob,
                        task_path = excluded.task_path;
                END IF;
            END $$""",
        ),
    ),
    Migration(
        6,
        "langgraph value storage without pglz",
        statements=(),
        # PostgreSQL TOASTs a row over ~2 KB: it first tries to compress its large values (pglz by
        # default, slow and useless on incompressible data: ~10% of the server CPU of a 16 KiB put went
        # to pglz_compress), then moves them out of line in ~2 KB chunks (a TOAST row and index entry
        # each). Rows of the checkpoint tables now stay whole in the heap up to toast_tuple_target
        # (8160, about one page: no compression attempt, no TOAST rows), and larger values are
        # compressed with lz4 where the server has it (PostgreSQL 14+ built --with-lz4); elsewhere the
        # column keeps the server's default. Neither rewrites existing rows: old values read as before.
        # SQLite needs nothing here.
        postgres_only=(
            "ALTER TABLE lg_checkpoints SET (toast_tuple_target = 8160)",
            "ALTER TABLE lg_blobs SET (toast_tuple_target = 8160)",
            "ALTER TABLE lg_writes SET (toast_tuple_target = 8160)",
            """DO $$
            BEGIN
                EXECUTE 'ALTER TABLE lg_checkpoints ALTER COLUMN checkpoint SET COMPRESSION lz4';
                EXECUTE 'ALTER TABLE lg_blobs ALTER COLUMN blob SET COMPRESSION lz4';
                EXECUTE 'ALTER TABLE lg_writes ALTER COLUMN blob SET COMPRESSION lz4';
            EXCEPTION WHEN feature_not_supported OR syntax_error OR invalid_parameter_value THEN
                RAISE NOTICE 'lz4 TOAST compression unavailable (%): keeping the default', SQLERRM;
            END $$""",
        ),
    ),
    Migration(
        7,
        "blob log position",
        statements=(),
        # SQLite's blob log (moorage/store/bloblog.py) appends into space it zero-filled ahead of time, so
        # the end of its data is not the file size: it is kept here, advanced in the transaction that
        # commits the rows pointing at the appended values. PostgreSQL keeps values in rows.
        sqlite_only=(
            """CREATE TABLE lg_log (
                id INTEGER PRIMARY KEY CHECK (id = 0), segment INTEGER NOT NULL, end_offset INTEGER NOT NULL)""",
        ),
    ),
    Migration(
        8,
        "langgraph batched checkpoint writes on SQLite",
        statements=(),
        # SQLite's counterpart of migration 5: a group-committed batch (checkpoints, channel blobs, pending
        # writes) is one multi-row INSERT into this view, run in autocommit mode, so taking the write lock,
        # every row and the commit (with its fsync) happen inside one call into SQLite. Python's sqlite3
        # module releases the GIL around each call and must win it back after each; with BEGIN, one step per
        # row and COMMIT, the committing thread queued for the GIL behind the writers preparing the next
        # batch several times per transaction. Each row names its target (``kind``: 0 checkpoint upsert,
        # 1 channel blob, 2 pending write kept as first written, 3 pending write replaced); a row of
        # another kind (NULL: padding) does nothing. PostgreSQL has moorage_lg_write.
        sqlite_only=(
            """CREATE VIEW lg_batch AS SELECT NULL AS kind, NULL AS c1, NULL AS c2, NULL AS c3, NULL AS c4,
                NULL AS c5, NULL AS c6, NULL AS c7, NULL AS c8, NULL AS c9 WHERE 0""",
            """CREATE TRIGGER lg_batch_checkpoint INSTEAD OF INSERT ON lg_batch WHEN NEW.kind = 0 BEGIN
                INSERT INTO lg_checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_id, run_id, type,
                                            checkpoint, metadata, versions)
                VALUES (NEW.c1, NEW.c2, NEW.c3, NEW.c4, NEW.c5, NEW.c6, NEW.c7, NEW.c8, NEW.c9)
                ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET
                    parent_id = excluded.parent_id, run_id = excluded.run_id, type = excluded.type,
                    checkpoint = excluded.checkpoint, metadata = excluded.metadata, versions = excluded.versions;
            END""",
            """CREATE TRIGGER lg_batch_blob INSTEAD OF INSERT ON lg_batch WHEN NEW.kind = 1 BEGIN
                INSERT INTO lg_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
                VALUES (NEW.c1, NEW.c2, NEW.c3, NEW.c4, NEW.c5, NEW.c6) ON CONFLICT DO NOTHING;
            END""",
            """CREATE TRIGGER lg_batch_write INSTEAD OF INSERT ON lg_batch WHEN NEW.kind = 2 BEGIN
                INSERT INTO lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob,
                                       task_path)
                VALUES (NEW.c1, NEW.c2, NEW.c3, NEW.c4, NEW.c5, NEW.c6, NEW.c7, NEW.c8, NEW.c9)
                ON CONFLICT DO NOTHING;
            END""",
            """CREATE TRIGGER lg_batch_write_replace INSTEAD OF INSERT ON lg_batch WHEN NEW.kind = 3 BEGIN
                INSERT INTO lg_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob,
                                       task_path)
                VALUES (NEW.c1, NEW.c2, NEW.c3, NEW.c4, NEW.c5, NEW.c6, NEW.c7, NEW.c8, NEW.c9)
                ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id, task_id, idx) DO UPDATE SET
                    channel = excluded.channel, type = excluded.type, blob = excluded.blob,
                    task_path = excluded.task_path;
            END""",
        ),
    ),
    Migration(
        9,
        "langgraph checkpoint reads in one call",
        statements=(),
        # PostgreSQL: a checkpoint with its channel blobs and pending writes is read by one function call, the
        # counterpart of moorage_lg_write: one autocommitted statement (prepared once per connection and run
        # without the GIL, see pg_prepared.py) instead of BEGIN, the tenant setting, the query and COMMIT
        # through psycopg's pipeline. SECURITY INVOKER: forced row-level security applies as in any
        # transaction, for the tenant it sets locally. ``p_id`` NULL reads the latest checkpoint; each case
        # is its own statement (one snapshot each, and a plan that probes the key for either).
        postgres_only=(
            f"""CREATE OR REPLACE FUNCTION moorage_lg_get(tenant TEXT, p_thread TEXT, p_ns TEXT, p_id TEXT)
            RETURNS TABLE (r_kind INTEGER, r_a TEXT, r_b TEXT, r_c TEXT, r_type TEXT, r_blob BYTEA, r_idx INTEGER,
                           r_versions TEXT)
            LANGUAGE plpgsql SECURITY INVOKER AS $$
            BEGIN
                IF tenant IS NULL OR tenant = '' THEN
                    RAISE EXCEPTION 'moorage_lg_get needs a tenant';
                END IF;
                PERFORM set_config('moorage.tenant_id', tenant, true);
                IF p_id IS NULL THEN
                    RETURN QUERY WITH cp AS ({_LG_GET_CP} ORDER BY k.checkpoint_id DESC LIMIT 1) {_LG_GET_ROWS};
                ELSE
                    RETURN QUERY WITH cp AS ({_LG_GET_CP} AND k.checkpoint_id = p_id) {_LG_GET_ROWS};
                END IF;
            END $$""",
        ),
    ),
    Migration(
        10,
        "events waiting for their embedding",
        statements=(
            # A turn's events are written without a vector (the reply does not wait for the model) and embedded
            # right after; a NULL embedding is the marker, and this partial index finds them after a restart.
            "CREATE INDEX events_unembedded ON events ({tpk}id) WHERE embedding IS NULL",
        ),
    ),
    Migration(
        11,
        "secrets: encrypted at rest, per agent and optionally per end-user",
        statements=(
            # Only ciphertext is stored (AES-GCM under the operator's key ``key_id``, bound to tenant, agent,
            # user and name); user_id '' is an agent-wide secret.
            """CREATE TABLE secrets (
                {tenant_col}
                agent_id TEXT NOT NULL, user_id TEXT NOT NULL, name TEXT NOT NULL, ciphertext {blob} NOT NULL,
                key_id TEXT NOT NULL, version INTEGER NOT NULL, created_at {real} NOT NULL, updated_at {real} NOT NULL,
                PRIMARY KEY ({tpk}agent_id, user_id, name))""",
        ),
        tenant_tables=("secrets",),
    ),
    Migration(
        12,
        "end-users per agent, async executions, webhooks with a durable delivery outbox",
        statements=(
            # The product's own user id under one agent: metadata and per-user limits (end_users stays the
            # tenant-wide registry the router checks).
            """CREATE TABLE agent_users (
                {tenant_col}
                agent_id TEXT NOT NULL, user_id TEXT NOT NULL, meta {json} NOT NULL, limits {json} NOT NULL,
                created_at {real} NOT NULL, updated_at {real} NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}agent_id, user_id))""",
            # An async turn: its status and result live in its workflow run (same id); this row keeps what
            # the caller streamed back and what has been announced to webhooks, so a restart loses neither.
            """CREATE TABLE executions (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, user_id TEXT NOT NULL, session TEXT NOT NULL,
                input {json} NOT NULL, events {json} NOT NULL, announced TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL,
                version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            "CREATE INDEX executions_open ON executions (announced, created_at)",
            """CREATE TABLE webhooks (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, url TEXT NOT NULL, events {json} NOT NULL,
                secret TEXT NOT NULL, enabled INTEGER NOT NULL, created_at {real} NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            # The outbox: a delivery is written in the transaction that decides it, then sent (and re-sent with
            # backoff) by whichever host claims it first; ``next_at`` doubles as the claim's lease.
            """CREATE TABLE webhook_deliveries (
                {tenant_col}
                id TEXT NOT NULL, webhook_id TEXT NOT NULL, event TEXT NOT NULL, payload {json} NOT NULL,
                status TEXT NOT NULL, attempts INTEGER NOT NULL, next_at {real}, created_at {real} NOT NULL,
                updated_at {real} NOT NULL, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            "CREATE INDEX webhook_deliveries_due ON webhook_deliveries (status, next_at)",
            """CREATE TABLE webhook_attempts (
                {tenant_col}
                delivery_id TEXT NOT NULL, seq INTEGER NOT NULL, at {real} NOT NULL, status_code INTEGER,
                error TEXT, duration_ms {real} NOT NULL,
                PRIMARY KEY ({tpk}delivery_id, seq))""",
        ),
        tenant_tables=("agent_users", "executions", "webhooks", "webhook_deliveries", "webhook_attempts"),
    ),
    Migration(
        13,
        "fleet leases: the fencing epoch of the host that owns an instance",
        statements=(
            # Changes whenever another host takes the instance over; a turn commit checks it (docs/fleet.md).
            "ALTER TABLE sandboxes ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        14,
        "share links: signed, expiring, revocable access to one user's app",
        statements=(
            # The token carries tenant, id and expiry under the host's signature; this row makes it revocable.
            """CREATE TABLE share_links (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, user_id TEXT NOT NULL, label TEXT NOT NULL,
                created_at {real} NOT NULL, expires_at {real} NOT NULL, revoked_at {real}, version INTEGER NOT NULL,
                PRIMARY KEY ({tpk}id))""",
            "CREATE INDEX share_links_user ON share_links ({tpk}agent_id, user_id)",
        ),
        tenant_tables=("share_links",),
    ),
    Migration(
        15,
        "agent checkpoints: per-instance manifests of row images, deduplicated bodies, branch heads",
        statements=(
            # One checkpoint of one instance (agent, end-user): the sandbox checkpoint it names, the highest event id
            # then (events are append-only) and a manifest (zlib JSON: table -> primary key -> digest) of the
            # instance's mutable rows; see docs/decisions/0011.
            """CREATE TABLE checkpoints (
                {tenant_col}
                id TEXT NOT NULL, agent_id TEXT NOT NULL, user_id TEXT NOT NULL, seq INTEGER NOT NULL,
                branch TEXT NOT NULL, parent_id TEXT, kind TEXT NOT NULL, name TEXT, turn_id TEXT,
                summary {json} NOT NULL, event_mark INTEGER NOT NULL, event_ranges {json} NOT NULL,
                manifest {blob} NOT NULL,
                sandbox_id TEXT, sandbox_checkpoint TEXT, store_bytes INTEGER NOT NULL, created_at {real} NOT NULL,
                PRIMARY KEY ({tpk}id), UNIQUE ({tpk}agent_id, user_id, seq))""",
            # Row images by digest, per instance: a row unchanged since the last checkpoint costs no new body.
            """CREATE TABLE checkpoint_rows (
                {tenant_col}
                agent_id TEXT NOT NULL, user_id TEXT NOT NULL, digest TEXT NOT NULL, tbl TEXT NOT NULL,
                body TEXT NOT NULL,
                PRIMARY KEY ({tpk}agent_id, user_id, digest))""",
            # Where the instance is: its current branch, the checkpoint that branch grows from and the event ids its
            # lineage holds (closed intervals, the last one open); ``pending`` holds an operation whose sandbox half
            # may be done and whose store half is not (finished on the next operation on the instance).
            """CREATE TABLE checkpoint_heads (
                {tenant_col}
                agent_id TEXT NOT NULL, user_id TEXT NOT NULL, branch TEXT NOT NULL, head_id TEXT,
                event_ranges {json} NOT NULL, pending {json}, version INTEGER NOT NULL, updated_at {real} NOT NULL,
                PRIMARY KEY ({tpk}agent_id, user_id))""",
            # Events a rollback took off the instance (another branch's), kept with their ids so that rolling
            # back to that branch puts them back; ``event_ranges`` above say which event ids a lineage holds.
            """CREATE TABLE checkpoint_events (
                {tenant_col}
                agent_id TEXT NOT NULL, user_id TEXT NOT NULL, id BIGINT NOT NULL, scope TEXT NOT NULL,
                ts {real} NOT NULL, kind TEXT NOT NULL, speaker TEXT, content TEXT NOT NULL, meta {json} NOT NULL,
                embedding {blob},
                PRIMARY KEY ({tpk}agent_id, user_id, id))""",
        ),
        tenant_tables=("checkpoints", "checkpoint_rows", "checkpoint_heads", "checkpoint_events"),
    ),
    Migration(
        16,
        "incremental checkpoints: a row version on every row a checkpoint images, kept by triggers",
        statements=(
            # ``rv``: when the row was last written (see store/repos/checkpoint_image.py); a checkpoint reads the
            # rows written since the head's ``row_mark``, not all of the instance's rows.
            *(f"ALTER TABLE {t} ADD COLUMN rv BIGINT NOT NULL DEFAULT 0" for t in _IMAGED),
            *(f"CREATE INDEX {t}_rv ON {t} ({{tpk}}rv)" for t in _IMAGED),
            # The instance's runs and journal entries by scope and run: a checkpoint's key scan and forget.
            "CREATE INDEX workflow_runs_scope ON workflow_runs ({tpk}scope)",
            "CREATE INDEX journal_scope ON journal ({tpk}scope)",
            "CREATE INDEX journal_run ON journal ({tpk}run_id)",
            "ALTER TABLE checkpoint_heads ADD COLUMN row_mark TEXT",
        ),
        sqlite_only=(
            # One writer at a time per database file: a clock each checkpoint moves on orders every write.
            "CREATE TABLE row_clock (id INTEGER PRIMARY KEY CHECK (id = 1), n INTEGER NOT NULL)",
            "INSERT INTO row_clock (id, n) VALUES (1, 1)",
            *(f"""CREATE TRIGGER {t}_rv_ins AFTER INSERT ON {t} BEGIN
                UPDATE {t} SET rv = (SELECT n FROM row_clock WHERE id = 1) WHERE rowid = NEW.rowid; END"""
              for t in _IMAGED),
            *(f"""CREATE TRIGGER {t}_rv_upd AFTER UPDATE ON {t}
                WHEN NEW.rv IS NOT (SELECT n FROM row_clock WHERE id = 1) BEGIN
                UPDATE {t} SET rv = (SELECT n FROM row_clock WHERE id = 1) WHERE rowid = NEW.rowid; END"""
              for t in _IMAGED),
        ),
        postgres_only=(
            # Concurrent writers: the writing transaction's id, compared with a snapshot (a late commit is seen).
            """CREATE OR REPLACE FUNCTION moorage_row_version() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN NEW.rv := pg_current_xact_id()::text::bigint; RETURN NEW; END $$""",
            *(f"CREATE TRIGGER {t}_rv BEFORE INSERT OR UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION "
              "moorage_row_version()" for t in _IMAGED),
        ),
    ),
    Migration(
        17,
        "facts: the comparable form of each value, and an index of the current facts by it",
        statements=(
            # ``value_key``: the value as the memory layer compares values (memory/extraction.normalize_value),
            # written with the row; NULL on rows written before this version or restored from a checkpoint
            # image, and filled in when a write first looks at them (store/repos/facts.current_matching).
            "ALTER TABLE facts ADD COLUMN value_key TEXT",
            # Only the facts not closed: a write's lookups (is this value already believed? already waiting?)
            # and a read of the current facts (of a scope, a subject or an attribute, by status) cost what is
            # current now, not every value ever held or every pending row piled up.
            "CREATE INDEX facts_current ON facts ({tpk}scope, status, subject, attribute, value_key) "
            "WHERE valid_to IS NULL",
        ),
    ),
    Migration(
        18,
        "incremental checkpoints that do not grow with history: each imaged row's instance, and deletions",
        statements=(
            # ``owner``: the instance ("agent/user") the row belongs to, set on insert (scopes and runs never
            # change); a checkpoint reads the rows written since its mark by (owner, rv), not by scanning the
            # instance's rows, which grow by a run per turn (docs/decisions/0011).
            *(f"ALTER TABLE {t} ADD COLUMN owner TEXT" for t in _IMAGED),
            *(f"CREATE INDEX {t}_owner ON {t} ({{tpk}}owner, rv)" for t in _IMAGED),
            # What a checkpoint must drop from its parent's manifest: rows deleted since its mark, of instances
            # that have a checkpoint (no log for instances nobody checkpoints). Deletions are rare (state deletes,
            # released claims, rollbacks); those older than every recent head's mark are removed, and
            # ``checkpoint_floor`` says below which they are gone (a head older than that reads its instance whole
            # once). Forgetting a user removes theirs.
            """CREATE TABLE row_deletions (
                {tenant_col}
                owner TEXT NOT NULL, tbl TEXT NOT NULL, k1 TEXT, k2 TEXT, k3 TEXT, rv BIGINT NOT NULL)""",
            "CREATE INDEX row_deletions_owner ON row_deletions ({tpk}owner, rv)",
            "CREATE INDEX row_deletions_rv ON row_deletions ({tpk}rv)",
            """CREATE TABLE checkpoint_floor (
                {tenant_col}
                id INTEGER NOT NULL, rv BIGINT NOT NULL, PRIMARY KEY ({tpk}id))""",
        ),
        tenant_tables=("row_deletions", "checkpoint_floor"),
        sqlite_only=(
            *(f"DROP TRIGGER {t}_rv_ins" for t in _IMAGED),
            *(f"""CREATE TRIGGER {t}_rv_ins AFTER INSERT ON {t} BEGIN
                UPDATE {t} SET rv = (SELECT n FROM row_clock WHERE id = 1), owner = {_owner_sqlite(t, "NEW")}
                WHERE rowid = NEW.rowid; END""" for t in _IMAGED),
            *(_gone_sqlite(t) for t in _IMAGED),
            # Rows written before: runs first (steps and journal entries take their run's owner).
            *(f"UPDATE {t} SET owner = {_owner_sqlite(t, t)}" for t in ("workflow_runs", "state", "facts", "steps",
                                                                      "journal", "sessions")),
        ),
        postgres_only=(
            f"""CREATE OR REPLACE FUNCTION moorage_scope_owner(s TEXT) RETURNS TEXT LANGUAGE sql IMMUTABLE AS
            $$ SELECT {_owner_of_scope_postgres("s")} $$""",
            """CREATE OR REPLACE FUNCTION moorage_row_owner() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_TABLE_NAME = 'sessions' THEN
                    NEW.owner := NEW.agent_id || '/' || NEW.user_id;
                ELSIF TG_TABLE_NAME = 'steps' THEN
                    NEW.owner := (SELECT w.owner FROM workflow_runs w WHERE w.tenant_id = NEW.tenant_id
                                  AND w.id = NEW.run_id);
                ELSE
                    NEW.owner := moorage_scope_owner(NEW.scope);
                    IF NEW.owner IS NULL AND TG_TABLE_NAME = 'journal' THEN
                        NEW.owner := (SELECT w.owner FROM workflow_runs w WHERE w.tenant_id = NEW.tenant_id
                                      AND w.id = NEW.run_id);
                    END IF;
                END IF;
                RETURN NEW;
            END $$""",
            """CREATE OR REPLACE FUNCTION moorage_row_gone() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE r JSONB := to_jsonb(OLD);
            BEGIN
                IF OLD.owner IS NOT NULL AND EXISTS (SELECT 1 FROM checkpoint_heads h
                        WHERE h.tenant_id = OLD.tenant_id AND h.agent_id = split_part(OLD.owner, '/', 1)
                        AND h.user_id = split_part(OLD.owner, '/', 2) AND h.row_mark IS NOT NULL) THEN
                    INSERT INTO row_deletions (tenant_id, owner, tbl, k1, k2, k3, rv) VALUES (
                        OLD.tenant_id, OLD.owner, TG_TABLE_NAME, r ->> TG_ARGV[0],
                        CASE WHEN TG_NARGS > 1 THEN r ->> TG_ARGV[1] END,
                        CASE WHEN TG_NARGS > 2 THEN r ->> TG_ARGV[2] END, pg_current_xact_id()::text::bigint);
                END IF;
                RETURN NULL;
            END $$""",
            *(f"CREATE TRIGGER {t}_owner BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION moorage_row_owner()"
              for t in _IMAGED),
            *(f"CREATE TRIGGER {t}_gone AFTER DELETE ON {t} FOR EACH ROW EXECUTE FUNCTION "
              f"moorage_row_gone({', '.join(repr(k) for k in _IMAGED_PK[t])})" for t in _IMAGED),
            # Rows written before, every tenant's: the owner role runs migrations, and forced row-level security
            # binds it too, so it is lifted for the backfill inside this migration's transaction.
            *(f"ALTER TABLE {t} NO FORCE ROW LEVEL SECURITY" for t in _IMAGED),
            "UPDATE workflow_runs SET owner = moorage_scope_owner(scope)",
            "UPDATE state SET owner = moorage_scope_owner(scope)",
            "UPDATE facts SET owner = moorage_scope_owner(scope)",
            "UPDATE steps s SET owner = w.owner FROM workflow_runs w WHERE w.tenant_id = s.tenant_id AND w.id = s.run_id",
            "UPDATE journal j SET owner = COALESCE(moorage_scope_owner(j.scope), (SELECT w.owner FROM workflow_runs w "
            "WHERE w.tenant_id = j.tenant_id AND w.id = j.run_id))",
            "UPDATE sessions SET owner = agent_id || '/' || user_id",
            *(f"ALTER TABLE {t} FORCE ROW LEVEL SECURITY" for t in _IMAGED),
        ),
    ),
    Migration(
        19,
        "spans by start time: the traces retention kind sweeps old spans without reading them all",
        statements=("CREATE INDEX spans_start ON spans ({tpk}start_ts)",),
    ),
    Migration(
        20,
        "facts: when a pending fact was confirmed, and an index of the pending facts of a scope",
        statements=(
            # ``confirmed_at``: a fact that waited for confirmation is believed from then, not from when it was
            # recorded (``known_at`` reads compare COALESCE(confirmed_at, recorded_at)). NULL on facts never
            # pending and on those confirmed before this version (no record of when).
            "ALTER TABLE facts ADD COLUMN confirmed_at {real}",
            # Only the pending rows: listing what waits for confirmation pages through them in recorded order.
            "CREATE INDEX facts_waiting ON facts ({tpk}scope, recorded_at, id) WHERE status = 'pending'",
        ),
    ),
    Migration(
        21,
        "spans: the end-user an unscoped span names, indexed, so forgetting a user does not read every span",
        statements=(
            # An HTTP request's span (or a share link's) has no scope; the user and agent it is about were only in
            # its JSON attributes, so forgetting a user read every such span. Set when the span is written
            # (store/repos/spans.py); scoped spans go with their scope and leave them NULL.
            "ALTER TABLE spans ADD COLUMN user_id TEXT",
            "ALTER TABLE spans ADD COLUMN agent_id TEXT",
            "CREATE INDEX spans_user ON spans ({tpk}user_id, agent_id) WHERE user_id IS NOT NULL",
        ),
        # Spans written before: filled in from their attributes, once (a user named by something else than a
        # string was never matched by forget either).
        sqlite_only=(
            """UPDATE spans SET user_id = json_extract(attrs, '$."moorage.user"'),
                agent_id = CASE WHEN json_type(attrs, '$."moorage.agent"') = 'text'
                                THEN json_extract(attrs, '$."moorage.agent"') END
                WHERE scope IS NULL AND json_type(attrs, '$."moorage.user"') = 'text'""",
        ),
        postgres_only=(
            # Every tenant's rows: forced row-level security binds the owner role running migrations too, so it is
            # lifted for the backfill inside this migration's transaction (as for migration 18).
            "ALTER TABLE spans NO FORCE ROW LEVEL SECURITY",
            """UPDATE spans SET user_id = (attrs::jsonb) ->> 'moorage.user',
                agent_id = CASE WHEN jsonb_typeof((attrs::jsonb) -> 'moorage.agent') = 'string'
                                THEN (attrs::jsonb) ->> 'moorage.agent' END
                WHERE scope IS NULL AND jsonb_typeof((attrs::jsonb) -> 'moorage.user') = 'string'""",
            "ALTER TABLE spans FORCE ROW LEVEL SECURITY",
        ),
    ),
    Migration(
        22,
        "sessions by activity: an agent's (or a user's) sessions page from the most recently active",
        statements=(
            "CREATE INDEX sessions_active ON sessions ({tpk}agent_id, last_active, user_id, id)",
            "CREATE INDEX sessions_user_active ON sessions ({tpk}agent_id, user_id, last_active, id)",
        ),
    ),
    Migration(
        23,
        "spans: the end-user an unscoped span names, also when a host of an earlier version wrote it",
        statements=(),
        # In a fleet the hosts are upgraded one at a time (docs/operations.md): a host not yet upgraded writes
        # request spans without ``user_id`` (migration 21), which forgetting the user would then miss. The store
        # fills it in from the attributes, as migration 21 did for the spans before. A single host (SQLite) is
        # stopped for its upgrade, so no earlier version writes to its upgraded store.
        postgres_only=(
            """CREATE OR REPLACE FUNCTION moorage_span_user() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF jsonb_typeof((NEW.attrs::jsonb) -> 'moorage.user') = 'string' THEN
                    NEW.user_id := (NEW.attrs::jsonb) ->> 'moorage.user';
                    IF jsonb_typeof((NEW.attrs::jsonb) -> 'moorage.agent') = 'string' THEN
                        NEW.agent_id := (NEW.attrs::jsonb) ->> 'moorage.agent';
                    END IF;
                END IF;
                RETURN NEW;
            END $$""",
            "CREATE TRIGGER spans_user BEFORE INSERT ON spans FOR EACH ROW "
            "WHEN (NEW.scope IS NULL AND NEW.user_id IS NULL) EXECUTE FUNCTION moorage_span_user()",
        ),
    ),
    Migration(
        24,
        "deployments: which process builds a deployment, so a deploy its host's death cut short is seen as failed",
        statements=(
            # The builder's mark (lifecycle/fleet.py ``claim_mark``: host, process, and in a fleet the host's
            # incarnation). NULL on deployments made before: a single host fails those at its next start.
            "ALTER TABLE deployments ADD COLUMN builder {json}",
        ),
    ),
    Migration(
        25,
        "webhook deliveries: the end-user each is about, indexed, so forgetting a user removes what was sent about them",
        statements=(
            # A delivery's payload holds what a turn said or an agent learned about one user (data.user); forgetting
            # them left every such payload in the outbox, kept for ever. Set when the delivery is made
            # (store/webhooks.py); filled in below for deliveries made before.
            "ALTER TABLE webhook_deliveries ADD COLUMN user_id TEXT",
            "ALTER TABLE webhook_deliveries ADD COLUMN agent_id TEXT",
            "CREATE INDEX webhook_deliveries_user ON webhook_deliveries ({tpk}user_id, agent_id) "
            "WHERE user_id IS NOT NULL",
            "CREATE INDEX webhook_deliveries_hook ON webhook_deliveries ({tpk}webhook_id, created_at)",
            "CREATE INDEX webhook_attempts_delivery ON webhook_attempts ({tpk}delivery_id)",
        ),
        sqlite_only=(
            """UPDATE webhook_deliveries SET user_id = json_extract(payload, '$.data.user'),
                agent_id = CASE WHEN json_type(payload, '$.data.agent') = 'text'
                                THEN json_extract(payload, '$.data.agent') END
                WHERE json_type(payload, '$.data.user') = 'text'""",
        ),
        postgres_only=(
            # Every tenant's rows (as for migration 21), and a host of an earlier version during a fleet's rolling
            # upgrade (as for migration 23) gets its deliveries' user filled in by the store.
            "ALTER TABLE webhook_deliveries NO FORCE ROW LEVEL SECURITY",
            """UPDATE webhook_deliveries SET user_id = (payload::jsonb) -> 'data' ->> 'user',
                agent_id = CASE WHEN jsonb_typeof((payload::jsonb) -> 'data' -> 'agent') = 'string'
                                THEN (payload::jsonb) -> 'data' ->> 'agent' END
                WHERE jsonb_typeof((payload::jsonb) -> 'data' -> 'user') = 'string'""",
            "ALTER TABLE webhook_deliveries FORCE ROW LEVEL SECURITY",
            """CREATE OR REPLACE FUNCTION moorage_delivery_user() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF jsonb_typeof((NEW.payload::jsonb) -> 'data' -> 'user') = 'string' THEN
                    NEW.user_id := (NEW.payload::jsonb) -> 'data' ->> 'user';
                    IF jsonb_typeof((NEW.payload::jsonb) -> 'data' -> 'agent') = 'string' THEN
                        NEW.agent_id := (NEW.payload::jsonb) -> 'data' ->> 'agent';
                    END IF;
                END IF;
                RETURN NEW;
            END $$""",
            "CREATE TRIGGER webhook_deliveries_user BEFORE INSERT ON webhook_deliveries FOR EACH ROW "
            "WHEN (NEW.user_id IS NULL) EXECUTE FUNCTION moorage_delivery_user()",
        ),
    ),
    Migration(
        26,
        "indexes for a big store: what forgetting a user, the retention sweep, caps and list pages read",
        # Each of these read every row of its table on a store of 50,000 users (bench/results/latest/scale.md):
        statements=(
            # a user's usage (their caps before each turn, GET /v1/usage?user=, forgetting them) and a scope's
            "CREATE INDEX usage_user ON usage ({tpk}user_id, agent_id, ts)",
            "CREATE INDEX usage_scope ON usage ({tpk}scope)",
            # whether any agent still has a user whose agent user was deleted (DELETE of a user)
            "CREATE INDEX agent_users_user ON agent_users ({tpk}user_id)",
            # a scope's spans (forgetting a user, the sweep of an expired scope)
            "CREATE INDEX spans_scope ON spans ({tpk}scope)",
            # a user's async turns (forgetting them)
            "CREATE INDEX executions_user ON executions ({tpk}user_id, agent_id)",
            # a page of instances (GET /v1/sandboxes, of one agent) and of workflow runs, in their order
            "CREATE INDEX sandboxes_active ON sandboxes ({tpk}last_active, id)",
            "CREATE INDEX sandboxes_agent_active ON sandboxes ({tpk}agent_id, last_active, id)",
            "CREATE INDEX workflow_runs_updated ON workflow_runs ({tpk}updated_at, id)",
            # settled deliveries past their TTL (the sweep)
            "CREATE INDEX webhook_deliveries_settled ON webhook_deliveries ({tpk}updated_at) WHERE status <> 'pending'",
        ),
        older_may_serve=True,  # indexes only
    ),
    Migration(
        27,
        "checkpoint heads with an operation left half done, indexed: a host's start reads those, not every head",
        statements=(
            # Recovery at each start (store/repos/checkpoints.py ``pending``) read every instance's head (50,000
            # on the store of bench/results/latest/scale.md) for the few with an operation cut short.
            "CREATE INDEX checkpoint_heads_pending ON checkpoint_heads ({tpk}agent_id, user_id) "
            "WHERE pending IS NOT NULL",
        ),
        older_may_serve=True,  # an index only
    ),
    Migration(
        28,
        "usage rollups: the ledger's sums per agent, UTC day and kind, and the instances' storage levels",
        # GET /v1/usage of a tenant or agent summed every ledger row since ``since`` and read every disk/snapshot
        # measurement into Python (381 ms at 50,000 users, bench/results/latest/scale.md); the tables and their
        # triggers are described in store/usage_rollups.py, moorage.usage reads them. A user's own usage (caps)
        # is read from the ledger through its index, as before.
        statements=usage_rollups.TABLES,
        tenant_tables=usage_rollups.TABLE_NAMES,
        sqlite_only=usage_rollups.SQLITE,
        postgres_only=usage_rollups.POSTGRES,
        older_may_serve=True,  # tables the store keeps up itself, whoever writes the ledger
    ),
    Migration(
        29,
        "automatic checkpoints whose files are written behind their turn, marked until written: a start reads those",
        statements=(
            # A host's start read every checkpoint with a correlated MAX(seq) for the few whose sandbox files a
            # killed host was still writing (0.5 s at 50,000 users, bench/results/latest/scale.md). ``writing`` is
            # 1 from the row's insert until its files are on disk (store/repos/checkpoints.py ``written_behind``).
            "ALTER TABLE checkpoints ADD COLUMN writing INTEGER",
            "CREATE INDEX checkpoints_writing ON checkpoints ({tpk}agent_id, user_id) WHERE writing = 1",
        ),
        # An older host writes rows without the mark (and checks them at its own start as before); a newer host's
        # start does not check the rows an older one left unwritten.
        older_may_serve=True,
    ),
    Migration(
        30,
        "the API key that started each execution: revoking a key cancels the async turns and detached execs it started",
        statements=(
            # The key's id (for an end-user token, the id of the key that issued it); NULL for the operator's own
            # work and for rows written before this migration. A revoke reads its key's queued turns by the index.
            "ALTER TABLE executions ADD COLUMN key_id TEXT",
            "CREATE INDEX executions_key ON executions ({tpk}key_id, announced) WHERE key_id IS NOT NULL",
        ),
        # An older host reads and writes executions naming their columns, so the new one is left NULL by it: the
        # work it starts is not cancelled by a revoke (as before this migration), and it does not stop work of a
        # revoked key that it runs. Everything else it does is unchanged, so it may serve during a rolling upgrade.
        older_may_serve=True,
    ),
    Migration(
        31,
        "usage rollups: the levels of the instances' sandbox checkpoint bytes, as of their disk and snapshot bytes",
        # A sleep measures the bytes of the instance's sandbox checkpoints (its RAM deltas and device states; a
        # process sandbox's copies of its layer) as the ledger kind ``checkpoint_bytes``, a level: the triggers of
        # migration 28 keep its levels too (store/usage_rollups.py ``SQLITE_31``/``POSTGRES_31``).
        statements=(),
        sqlite_only=usage_rollups.SQLITE_31,
        postgres_only=usage_rollups.POSTGRES_31,
        # An older host writes no such rows and reads a tenant's and an agent's levels of every kind from the
        # rollups; a user's ``checkpoint_bytes`` it sums over their sleeps, as a kind it does not know is a level.
        older_may_serve=True,
    ),
    Migration(
        32,
        "deployments: the size of each one's package (a tenant's storage counts its packages)",
        statements=("ALTER TABLE deployments ADD COLUMN package_bytes BIGINT",),
        # An older host names the columns it writes: its deployments have no size and are not counted.
        older_may_serve=True,
    ),
)


CONTROL_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "tenants and api keys",
        statements=(
            """CREATE TABLE tenants (
                id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, created_at {real} NOT NULL,
                version INTEGER NOT NULL)""",
            """CREATE TABLE api_keys (
                id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, key_hash TEXT NOT NULL UNIQUE,
                scopes TEXT NOT NULL, label TEXT NOT NULL, created_at {real} NOT NULL, revoked_at {real})""",
            "CREATE INDEX api_keys_tenant ON api_keys (tenant_id)",
        ),
    ),
    Migration(
        2,
        "fleet hosts: registration and heartbeats (a host's leases are valid while its heartbeat is fresh)",
        statements=(
            """CREATE TABLE hosts (
                id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, started_at {real} NOT NULL,
                heartbeat_at {real} NOT NULL, incarnation TEXT NOT NULL, load {json} NOT NULL,
                version INTEGER NOT NULL)""",
        ),
    ),
    Migration(
        3,
        "fleet hosts: fingerprints of the installation secrets every host must share (checked when a host joins)",
        statements=("ALTER TABLE hosts ADD COLUMN secrets {json} NOT NULL DEFAULT '{{}}'",),
    ),
    Migration(
        4,
        "tenants: the operator's limits of each tenant (its own tenant_max_storage_mib)",
        statements=("ALTER TABLE tenants ADD COLUMN limits {json} NOT NULL DEFAULT '{{}}'",),
        # Older hosts name the columns they read and write: they apply the operator's default to every tenant.
        older_may_serve=True,
    ),
    Migration(
        5,
        "tenants: when a tenant's deletion began (DELETE /v1/tenants/{tenant}; runtime/tenant_delete.py)",
        statements=("ALTER TABLE tenants ADD COLUMN deleting_since {real}",),
        # Older hosts name the columns they read: a tenant being deleted is one more tenant to them.
        older_may_serve=True,
    ),
)

LATEST_TENANT_VERSION = TENANT_MIGRATIONS[-1].version


def render(sql: str, dialect: str) -> str:
    if dialect == "postgres":
        subs = {
            "tenant_col": "tenant_id TEXT NOT NULL DEFAULT current_setting('moorage.tenant_id'),",
            "tpk": "tenant_id, ",
            "blob": "BYTEA",
            "real": "DOUBLE PRECISION",
            "autoid": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
            "json": "TEXT",
        }
    else:
        subs = {
            "tenant_col": "",
            "tpk": "",
            "blob": "BLOB",
            "real": "REAL",
            "autoid": "INTEGER PRIMARY KEY AUTOINCREMENT",
            "json": "TEXT",
        }
    return sql.format(**subs)


def statements_for(m: Migration, dialect: str) -> list[str]:
    extra = m.postgres_only if dialect == "postgres" else m.sqlite_only
    return [render(s, dialect) for s in (*m.statements, *extra, *m.after)]


#: Ends the name ``schema_migrations`` records for a migration that is ``older_may_serve``.
OLDER_MAY_SERVE = " [older versions may serve]"


def recorded_name(m: Migration) -> str:
    """The name ``schema_migrations`` records for ``m``: it says whether an older moorage may serve past it."""
    return m.name + (OLDER_MAY_SERVE if m.older_may_serve else "")


def refuse_newer_schema(newest: int, migrations: tuple[Migration, ...],
                        newer_names: Callable[[int], list[str]] | None = None) -> None:
    """A database a newer moorage migrated past what this one knows is refused before anything is written to it:
    this version would misread or damage it (docs/operations.md: there is no migration back). Unless every
    migration past what it knows was recorded as one an older moorage may serve past (``newer_names(known)``: the
    names recorded for the versions above ``known``): then it serves, and says so."""
    known = migrations[-1].version if migrations else 0
    if newest <= known:
        return
    names = newer_names(known) if newer_names is not None else []
    if len(names) == newest - known and all(n.endswith(OLDER_MAY_SERVE) for n in names):
        from moorage.log import get_logger

        get_logger(__name__).warning(
            "the store was migrated by a newer moorage; its migrations past this version's leave this version "
            "working: upgrade this host too", store_schema=newest, known=known)
        return
    raise ConfigError(f"the store's schema is at version {newest}, newer than this moorage knows ({known}): a "
                      "newer moorage migrated it",
                      hint="run that newer moorage (in a rolling upgrade of a fleet: upgrade this host now), or "
                           "restore the copy of the data directory (or database) taken before the upgrade")
