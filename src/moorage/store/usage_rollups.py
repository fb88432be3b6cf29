"""Store migration 28: rollups of the usage ledger, kept by triggers as ledger rows are written and deleted, so
a tenant's or an agent's usage costs the same after a year of use (moorage.usage.ledger reads them).

- ``usage_days``: the ledger's sums per agent, UTC day and kind (what ``Usage.totals`` summed row by row).
- ``usage_levels``: each instance's (scope's) disk, snapshot and checkpoint bytes (``GAUGES``; migration 31 added
  the checkpoints') at its latest measurement (``day`` -1) and
  at its last measurement of each UTC day (``day`` d): the ledger row latest by (ts, id), as the reads picked it.
- ``usage_level_days``: those levels summed per agent, kind and UTC day of the measurement (``latest`` 1: the
  instances' latest levels; 0: each day's last levels), so neither totals nor days read every instance.

``shard``: on PostgreSQL the row id modulo 8 (``usage_days``) or a hash of the instance modulo 8
(``usage_level_days``: a level that moves to an instance's next measurement stays in its shard), so concurrent
writers add to different rows rather than queue on one row's lock; on SQLite (one writer per tenant) always 0.

Lock order on PostgreSQL: a transaction that writes ledger rows of an agent holds a shared advisory lock of the
agent (``_PG_AGENT_LOCK``) before it touches the agent's rollup rows; one that deletes them (forgetting a user, the
sweep of a scope, retention) an exclusive one. A deletion touches many shared rollup rows in the order its rows
come, a sleep a few in its own: without the lock the two deadlocked (one of them failed, 40P01). Writers do not
wait for each other, and each writer takes the rows of a measurement in one order (its day, then its shard's
level rows by day), so two writers do not deadlock either. A deletion that spans several agents (forgetting a
user of every agent, the ledger's retention sweep) takes their exclusive locks first, ordered by lock key
(``lock_agents``): taken row by row, in its rows' order, two of them took the same agents in opposite orders and
deadlocked. ``n``: the rows summed; a rollup none is left of is
deleted, so it never keeps a float's remainder. The triggers run for every writer, a host of an earlier version
in a fleet's rolling upgrade included.
"""

from __future__ import annotations

from typing import Any, Sequence

from moorage.store.sql import Conn

#: The ledger kinds that are levels (an instance's bytes at each sleep) as migration 28 made the triggers ...
GAUGES_28 = ("disk_bytes", "snapshot_bytes")
#: ... and as migration 31 made them: with the bytes of the instance's sandbox checkpoints (moorage.usage.ledger).
GAUGES = (*GAUGES_28, "checkpoint_bytes")


def _in(gauges: Sequence[str]) -> str:
    return "(" + ", ".join(f"'{g}'" for g in gauges) + ")"


TABLES = (
    """CREATE TABLE usage_days (
        {tenant_col}
        agent_id TEXT NOT NULL, day BIGINT NOT NULL, kind TEXT NOT NULL, shard INTEGER NOT NULL,
        amount {real} NOT NULL, n BIGINT NOT NULL,
        PRIMARY KEY ({tpk}agent_id, day, kind, shard))""",
    "CREATE INDEX usage_days_day ON usage_days ({tpk}day)",
    """CREATE TABLE usage_levels (
        {tenant_col}
        scope TEXT NOT NULL, kind TEXT NOT NULL, day BIGINT NOT NULL, agent_id TEXT, user_id TEXT,
        ts {real} NOT NULL, row_id BIGINT NOT NULL, amount {real} NOT NULL,
        PRIMARY KEY ({tpk}scope, kind, day))""",
    "CREATE INDEX usage_levels_ts ON usage_levels ({tpk}day, ts)",
    "CREATE INDEX usage_levels_agent ON usage_levels ({tpk}agent_id, day, ts)",
    """CREATE TABLE usage_level_days (
        {tenant_col}
        agent_id TEXT NOT NULL, latest INTEGER NOT NULL, day BIGINT NOT NULL, kind TEXT NOT NULL,
        shard INTEGER NOT NULL, amount {real} NOT NULL, n BIGINT NOT NULL,
        PRIMARY KEY ({tpk}agent_id, latest, day, kind, shard))""",
    "CREATE INDEX usage_level_days_day ON usage_level_days ({tpk}latest, day)",
    # An instance's measurements in time order (its level after one is deleted); forgetting a user and the sweep
    # of an expired scope still find a scope's rows through it.
    "DROP INDEX usage_scope",
    "CREATE INDEX usage_scope_kind ON usage ({tpk}scope, kind, ts)",
)

_LEVEL_COLS = "scope, kind, day, agent_id, user_id, ts, row_id, amount"


def _sqlite_level_fallback(day: str, gauges: Sequence[str]) -> str:
    """After the deletion of the ledger row a level was (its ``day`` -1 or its UTC day): the latest row left."""
    in_day = "" if day == "-1" else (f"AND ts >= {day} * 86400.0 - 1 AND ts < {day} * 86400.0 + 86401 "
                                     f"AND CAST(ts / 86400 AS INTEGER) = {day} ")
    return (f"""CREATE TRIGGER usage_levels_ad{'' if day == '-1' else '_day'} AFTER DELETE ON usage
        WHEN OLD.kind IN {_in(gauges)} AND EXISTS (SELECT 1 FROM usage_levels WHERE scope = COALESCE(OLD.scope, '')
            AND kind = OLD.kind AND day = {day} AND row_id = OLD.id) BEGIN
        DELETE FROM usage_levels WHERE scope = COALESCE(OLD.scope, '') AND kind = OLD.kind AND day = {day};
        INSERT INTO usage_levels ({_LEVEL_COLS})
        SELECT COALESCE(scope, ''), kind, {day}, agent_id, user_id, ts, id, amount FROM usage
        WHERE scope IS OLD.scope AND kind = OLD.kind {in_day}ORDER BY ts DESC, id DESC LIMIT 1;
    END""")


def _sqlite_level_sum(op: str, row: str, sign: str) -> str:
    day = f"CAST({row}.ts / 86400 AS INTEGER)"
    if sign == "+":
        return (f"INSERT INTO usage_level_days (agent_id, latest, day, kind, shard, amount, n) "
                f"VALUES (COALESCE({row}.agent_id, ''), {row}.day = -1, {day}, {row}.kind, 0, {row}.amount, 1) "
                "ON CONFLICT (agent_id, latest, day, kind, shard) DO UPDATE SET amount = amount + excluded.amount, "
                "n = n + 1;")
    where = (f"agent_id = COALESCE({row}.agent_id, '') AND latest = ({row}.day = -1) AND day = {day} "
             f"AND kind = {row}.kind AND shard = 0")
    return (f"UPDATE usage_level_days SET amount = amount - {row}.amount, n = n - 1 WHERE {where}; "
            f"DELETE FROM usage_level_days WHERE {where} AND n <= 0;")


def _sqlite_levels_backfill(gauges: Sequence[str]) -> tuple[str, str]:
    """The levels of the ledger rows of ``gauges`` written before triggers kept them: latest, and per UTC day."""
    return (
        f"""INSERT INTO usage_levels ({_LEVEL_COLS})
            SELECT s, kind, d, agent_id, user_id, ts, id, amount FROM (
                SELECT COALESCE(scope, '') AS s, kind, -1 AS d, agent_id, user_id, ts, id, amount, ROW_NUMBER() OVER (
                    PARTITION BY COALESCE(scope, ''), kind ORDER BY ts DESC, id DESC) AS rn
                FROM usage WHERE kind IN {_in(gauges)}) WHERE rn = 1""",
        f"""INSERT INTO usage_levels ({_LEVEL_COLS})
            SELECT s, kind, d, agent_id, user_id, ts, id, amount FROM (
                SELECT COALESCE(scope, '') AS s, kind, CAST(ts / 86400 AS INTEGER) AS d, agent_id, user_id, ts, id,
                       amount,
                       ROW_NUMBER() OVER (PARTITION BY COALESCE(scope, ''), kind, CAST(ts / 86400 AS INTEGER)
                                          ORDER BY ts DESC, id DESC) AS rn
                FROM usage WHERE kind IN {_in(gauges)}) WHERE rn = 1""",
    )


def _sqlite_level_triggers(gauges: Sequence[str]) -> tuple[str, str, str]:
    """An instance's levels of ``gauges`` follow its measurements: a new one replaces them, a deleted one falls back
    to the latest left."""
    return (
        f"""CREATE TRIGGER usage_levels_ai AFTER INSERT ON usage WHEN NEW.kind IN {_in(gauges)} BEGIN
            INSERT INTO usage_levels ({_LEVEL_COLS})
            VALUES (COALESCE(NEW.scope, ''), NEW.kind, -1, NEW.agent_id, NEW.user_id, NEW.ts, NEW.id, NEW.amount),
                   (COALESCE(NEW.scope, ''), NEW.kind, CAST(NEW.ts / 86400 AS INTEGER), NEW.agent_id, NEW.user_id,
                    NEW.ts, NEW.id, NEW.amount)
            ON CONFLICT (scope, kind, day) DO UPDATE SET agent_id = excluded.agent_id, user_id = excluded.user_id,
                ts = excluded.ts, row_id = excluded.row_id, amount = excluded.amount
            WHERE excluded.ts > usage_levels.ts
                OR (excluded.ts = usage_levels.ts AND excluded.row_id > usage_levels.row_id);
        END""",
        _sqlite_level_fallback("-1", gauges),
        _sqlite_level_fallback("CAST(OLD.ts / 86400 AS INTEGER)", gauges),
    )


SQLITE = (
    """INSERT INTO usage_days (agent_id, day, kind, shard, amount, n)
        SELECT COALESCE(agent_id, ''), CAST(ts / 86400 AS INTEGER), kind, 0, SUM(amount), COUNT(*)
        FROM usage GROUP BY 1, 2, 3""",
    # The levels' sums follow the levels (created first: the backfill of the levels below fills them).
    f"CREATE TRIGGER usage_level_days_ai AFTER INSERT ON usage_levels BEGIN {_sqlite_level_sum('ai', 'NEW', '+')} END",
    f"CREATE TRIGGER usage_level_days_ad AFTER DELETE ON usage_levels BEGIN {_sqlite_level_sum('ad', 'OLD', '-')} END",
    f"CREATE TRIGGER usage_level_days_au AFTER UPDATE ON usage_levels BEGIN {_sqlite_level_sum('au', 'OLD', '-')} "
    f"{_sqlite_level_sum('au', 'NEW', '+')} END",
    *_sqlite_levels_backfill(GAUGES_28),
    """CREATE TRIGGER usage_days_ai AFTER INSERT ON usage BEGIN
        INSERT INTO usage_days (agent_id, day, kind, shard, amount, n)
        VALUES (COALESCE(NEW.agent_id, ''), CAST(NEW.ts / 86400 AS INTEGER), NEW.kind, 0, NEW.amount, 1)
        ON CONFLICT (agent_id, day, kind, shard) DO UPDATE SET amount = amount + excluded.amount, n = n + 1;
    END""",
    """CREATE TRIGGER usage_days_ad AFTER DELETE ON usage BEGIN
        UPDATE usage_days SET amount = amount - OLD.amount, n = n - 1
        WHERE agent_id = COALESCE(OLD.agent_id, '') AND day = CAST(OLD.ts / 86400 AS INTEGER)
        AND kind = OLD.kind AND shard = 0;
        DELETE FROM usage_days WHERE agent_id = COALESCE(OLD.agent_id, '')
        AND day = CAST(OLD.ts / 86400 AS INTEGER) AND kind = OLD.kind AND shard = 0 AND n <= 0;
    END""",
    *_sqlite_level_triggers(GAUGES_28),
)


_PG_LEVEL_FALLBACK = """
                    DELETE FROM usage_levels WHERE tenant_id = OLD.tenant_id AND scope = COALESCE(OLD.scope, '')
                    AND kind = OLD.kind AND day = {day} AND row_id = OLD.id;
                    IF FOUND THEN
                        INSERT INTO usage_levels (tenant_id, {cols})
                        SELECT tenant_id, COALESCE(scope, ''), kind, {day}, agent_id, user_id, ts, id, amount
                        FROM usage WHERE tenant_id = OLD.tenant_id AND kind = OLD.kind
                        AND (scope = OLD.scope OR (OLD.scope IS NULL AND scope IS NULL)) {in_day}
                        ORDER BY ts DESC, id DESC LIMIT 1;
                    END IF;"""
_PG_DAY = "floor(OLD.ts / 86400)::BIGINT"
_PG_IN_DAY = (f"AND ts >= {_PG_DAY} * 86400.0 - 1 AND ts < {_PG_DAY} * 86400.0 + 86401 "
              f"AND floor(ts / 86400)::BIGINT = {_PG_DAY}")
#: The advisory lock of a row's tenant and agent (its two-key form: no other lock of the store's is taken so).
_PG_AGENT_LOCK = "1970495847, hashtext({row}.tenant_id || ':' || COALESCE({row}.agent_id, ''))"
#: The second key of a ledger row's ``_PG_AGENT_LOCK``, over the ``usage`` table's own columns.
PG_AGENT_KEY = "hashtext(tenant_id || ':' || COALESCE(agent_id, ''))"


def lock_agents(c: Conn, *rows: tuple[str, Sequence[Any]]) -> None:
    """Before a deletion of the ledger rows matching any of ``rows`` (``where``, params): on PostgreSQL, take the
    exclusive locks of their agents that its triggers take row by row, all at once in ascending key order, so that
    two deletions across agents never hold one each of two agents while waiting for the other's (a row written
    since, of an agent not locked here, locks it late: the store breaks that rare deadlock and the caller retries).
    Each ``where`` is read on its own (an OR of them reads every row of the ledger)."""
    if c.dialect != "postgres":
        return  # SQLite: one writer per tenant, no locks to order
    union = " UNION ".join(f"SELECT {PG_AGENT_KEY} AS k FROM usage WHERE {where}" for where, _ in rows)
    keys = [r[0] for r in c.q(union, [p for _, params in rows for p in params])]
    take_agent_locks(c, keys)


def take_agent_locks(c: Conn, keys: Sequence[int]) -> None:
    """The exclusive locks of the agents with these ``PG_AGENT_KEY`` values, in ascending order (PostgreSQL only)."""
    for key in sorted(set(keys)):
        c.q("SELECT pg_advisory_xact_lock(1970495847, ?)", (key,))


def _pg_levels_backfill(gauges: Sequence[str]) -> tuple[str, str]:
    """The levels of the ledger rows of ``gauges`` written before triggers kept them, of every tenant."""
    return (
        f"""INSERT INTO usage_levels (tenant_id, {_LEVEL_COLS})
            SELECT tenant_id, s, kind, d, agent_id, user_id, ts, id, amount FROM (
                SELECT tenant_id, COALESCE(scope, '') AS s, kind, -1 AS d, agent_id, user_id, ts, id, amount,
                       ROW_NUMBER() OVER (PARTITION BY tenant_id, COALESCE(scope, ''), kind
                                          ORDER BY ts DESC, id DESC) AS rn
                FROM usage WHERE kind IN {_in(gauges)}) x WHERE rn = 1""",
        f"""INSERT INTO usage_levels (tenant_id, {_LEVEL_COLS})
            SELECT tenant_id, s, kind, d, agent_id, user_id, ts, id, amount FROM (
                SELECT tenant_id, COALESCE(scope, '') AS s, kind, floor(ts / 86400)::BIGINT AS d, agent_id, user_id, ts,
                       id, amount, ROW_NUMBER() OVER (PARTITION BY tenant_id, COALESCE(scope, ''), kind,
                                                      floor(ts / 86400)::BIGINT ORDER BY ts DESC, id DESC) AS rn
                FROM usage WHERE kind IN {_in(gauges)}) x WHERE rn = 1""",
    )


def _pg_rollup(gauges: Sequence[str]) -> str:
    """The ledger's trigger function: its sums per day, and the levels of ``gauges``; the agent's lock first."""
    return (
        f"""CREATE OR REPLACE FUNCTION moorage_usage_rollup() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                PERFORM pg_advisory_xact_lock_shared({_PG_AGENT_LOCK.format(row='NEW')});
                INSERT INTO usage_days (tenant_id, agent_id, day, kind, shard, amount, n)
                VALUES (NEW.tenant_id, COALESCE(NEW.agent_id, ''), floor(NEW.ts / 86400)::BIGINT, NEW.kind,
                        (NEW.id % 8)::INTEGER, NEW.amount, 1)
                ON CONFLICT (tenant_id, agent_id, day, kind, shard) DO UPDATE
                SET amount = usage_days.amount + EXCLUDED.amount, n = usage_days.n + 1;
                IF NEW.kind IN {_in(gauges)} THEN
                    INSERT INTO usage_levels (tenant_id, {_LEVEL_COLS})
                    VALUES (NEW.tenant_id, COALESCE(NEW.scope, ''), NEW.kind, -1, NEW.agent_id, NEW.user_id, NEW.ts,
                            NEW.id, NEW.amount),
                           (NEW.tenant_id, COALESCE(NEW.scope, ''), NEW.kind, floor(NEW.ts / 86400)::BIGINT,
                            NEW.agent_id, NEW.user_id, NEW.ts, NEW.id, NEW.amount)
                    ON CONFLICT (tenant_id, scope, kind, day) DO UPDATE SET agent_id = EXCLUDED.agent_id,
                        user_id = EXCLUDED.user_id, ts = EXCLUDED.ts, row_id = EXCLUDED.row_id, amount = EXCLUDED.amount
                    WHERE EXCLUDED.ts > usage_levels.ts
                        OR (EXCLUDED.ts = usage_levels.ts AND EXCLUDED.row_id > usage_levels.row_id);
                END IF;
                RETURN NULL;
            END IF;
            PERFORM pg_advisory_xact_lock({_PG_AGENT_LOCK.format(row='OLD')});
            UPDATE usage_days SET amount = amount - OLD.amount, n = n - 1
            WHERE tenant_id = OLD.tenant_id AND agent_id = COALESCE(OLD.agent_id, '')
            AND day = floor(OLD.ts / 86400)::BIGINT AND kind = OLD.kind AND shard = (OLD.id % 8)::INTEGER;
            DELETE FROM usage_days WHERE tenant_id = OLD.tenant_id AND agent_id = COALESCE(OLD.agent_id, '')
            AND day = floor(OLD.ts / 86400)::BIGINT AND kind = OLD.kind AND shard = (OLD.id % 8)::INTEGER AND n <= 0;
            IF OLD.kind IN {_in(gauges)} THEN{_PG_LEVEL_FALLBACK.format(day='-1', cols=_LEVEL_COLS, in_day='')}{
                _PG_LEVEL_FALLBACK.format(day=_PG_DAY, cols=_LEVEL_COLS, in_day=_PG_IN_DAY)}
            END IF;
            RETURN NULL;
        END $$""")


POSTGRES = (
    # Every tenant's rows (forced row-level security binds the owner running migrations, as for migration 21).
    "ALTER TABLE usage NO FORCE ROW LEVEL SECURITY",
    """INSERT INTO usage_days (tenant_id, agent_id, day, kind, shard, amount, n)
        SELECT tenant_id, COALESCE(agent_id, ''), floor(ts / 86400)::BIGINT, kind, (id % 8)::INTEGER,
               SUM(amount), COUNT(*)
        FROM usage GROUP BY 1, 2, 3, 4, 5""",
    """CREATE OR REPLACE FUNCTION moorage_usage_level_days() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP IN ('DELETE', 'UPDATE') THEN
            UPDATE usage_level_days SET amount = amount - OLD.amount, n = n - 1
            WHERE tenant_id = OLD.tenant_id AND agent_id = COALESCE(OLD.agent_id, '') AND latest = (OLD.day = -1)::INTEGER
            AND day = floor(OLD.ts / 86400)::BIGINT AND kind = OLD.kind AND shard = (hashtext(OLD.scope) & 7);
            DELETE FROM usage_level_days
            WHERE tenant_id = OLD.tenant_id AND agent_id = COALESCE(OLD.agent_id, '') AND latest = (OLD.day = -1)::INTEGER
            AND day = floor(OLD.ts / 86400)::BIGINT AND kind = OLD.kind AND shard = (hashtext(OLD.scope) & 7)
            AND n <= 0;
        END IF;
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            INSERT INTO usage_level_days (tenant_id, agent_id, latest, day, kind, shard, amount, n)
            VALUES (NEW.tenant_id, COALESCE(NEW.agent_id, ''), (NEW.day = -1)::INTEGER, floor(NEW.ts / 86400)::BIGINT,
                    NEW.kind, hashtext(NEW.scope) & 7, NEW.amount, 1)
            ON CONFLICT (tenant_id, agent_id, latest, day, kind, shard) DO UPDATE
            SET amount = usage_level_days.amount + EXCLUDED.amount, n = usage_level_days.n + 1;
        END IF;
        RETURN NULL;
    END $$""",
    "CREATE TRIGGER usage_level_days AFTER INSERT OR UPDATE OR DELETE ON usage_levels FOR EACH ROW "
    "EXECUTE FUNCTION moorage_usage_level_days()",
    *_pg_levels_backfill(GAUGES_28),
    "ALTER TABLE usage FORCE ROW LEVEL SECURITY",
    _pg_rollup(GAUGES_28),
    "CREATE TRIGGER usage_rollup AFTER INSERT OR DELETE ON usage FOR EACH ROW EXECUTE FUNCTION moorage_usage_rollup()",
)


TABLE_NAMES = ("usage_days", "usage_levels", "usage_level_days")

#: Migration 31: the triggers keep the levels of ``GAUGES`` (the sandbox checkpoints' bytes besides disk and
#: snapshot), and the levels of rows of the new kinds written before it are built.
_ADDED = GAUGES[len(GAUGES_28):]
SQLITE_31 = (
    "DROP TRIGGER usage_levels_ai",
    "DROP TRIGGER usage_levels_ad",
    "DROP TRIGGER usage_levels_ad_day",
    *_sqlite_level_triggers(GAUGES),
    *_sqlite_levels_backfill(_ADDED),
)
POSTGRES_31 = (
    # Every tenant's rows, read and written by the owner running migrations (as in migration 28).
    *(f"ALTER TABLE {t} NO FORCE ROW LEVEL SECURITY" for t in ("usage", *TABLE_NAMES)),
    *_pg_levels_backfill(_ADDED),
    *(f"ALTER TABLE {t} FORCE ROW LEVEL SECURITY" for t in ("usage", *TABLE_NAMES)),
    _pg_rollup(GAUGES),  # the trigger ``usage_rollup`` runs the function by name: it runs the new one
)
