"""The SQL behind ``MoorageSaver``, rendered once per dialect (SQLite file per tenant, PostgreSQL with RLS).

On PostgreSQL every key starts with ``tenant_id`` (filled from ``moorage.tenant_id``), so conflict targets name it.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any, Sequence

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

_CHECKPOINT_COLS = "thread_id, checkpoint_ns, checkpoint_id, parent_id, run_id, type, checkpoint, metadata, versions"
_BLOB_COLS = "thread_id, checkpoint_ns, channel, version, type, blob"
_LIST_COLS = "thread_id, checkpoint_ns, checkpoint_id, parent_id, type, checkpoint, metadata, versions"
_WRITE_COLS = "thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, task_path"
# Metadata keys we can address with a JSON path literal on SQLite; anything else is filtered in Python.
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_\-]{1,200}$")


_CHECKPOINT_TYPES = ("text",) * 6 + ("bytea", "text", "text")
_BLOB_TYPES = ("text",) * 5 + ("bytea",)
_WRITE_TYPES = ("text",) * 4 + ("integer", "text", "text", "bytea", "text")


# Column -> the suffix of its moorage_lg_write parameter (schema migration 5).
_FN_NAMES = {"thread_id": "thread", "checkpoint_ns": "ns", "checkpoint_id": "id", "parent_id": "parent", "run_id": "run",
             "checkpoint": "blob", "metadata": "meta", "task_id": "task", "task_path": "path"}


class _Array(list):
    """A column of a batch, sent to PostgreSQL as one binary array (``array_send`` format) built here.

    psycopg's generic list adaptation inspects every element's type to pick its dumper; for the
    batch's columns, whose element types are fixed, that was the largest part of the client's CPU per
    put (~40% on 1 KiB states). Subclasses fix the element type; None is SQL NULL.
    """

    __slots__ = ()
    #: The element type's oid; subclasses also define ``item(value) -> bytes``, its binary form.
    elem_oid = 0


class _TextArray(_Array):
    __slots__ = ()
    elem_oid = 25

    @staticmethod
    def item(v: Any) -> bytes:
        return v.encode() if isinstance(v, str) else str(v).encode()


class _ByteaArray(_Array):
    __slots__ = ()
    elem_oid = 17

    @staticmethod
    def item(v: Any) -> bytes:
        return v if isinstance(v, bytes) else bytes(v)


class _Int4Array(_Array):
    __slots__ = ()
    elem_oid = 23

    @staticmethod
    def item(v: Any) -> bytes:
        return struct.pack(">i", v)


_ARRAY_OIDS = {25: 1009, 17: 1001, 23: 1007}
_HEAD = struct.Struct(">iiiii")
_LEN = struct.Struct(">i")
_NULL = _LEN.pack(-1)


class _ArrayDumper(Dumper):
    format = Format.BINARY

    def __init__(self, cls: type, context: Any = None) -> None:
        super().__init__(cls, context)
        self.oid = _ARRAY_OIDS[cls.elem_oid]  # type: ignore[attr-defined]

    def dump(self, obj: _Array) -> bytes:
        item = obj.item  # type: ignore[attr-defined]
        parts = [_HEAD.pack(1, 1 if None in obj else 0, obj.elem_oid, len(obj), 1)]
        for v in obj:
            if v is None:
                parts.append(_NULL)
            else:
                b = item(v)
                parts.append(_LEN.pack(len(b)))
                parts.append(b)
        return b"".join(parts)


for _cls in (_TextArray, _ByteaArray, _Int4Array):
    psycopg.adapters.register_dumper(_cls, _ArrayDumper)
_ARRAY_TYPES = {"text": _TextArray, "bytea": _ByteaArray, "integer": _Int4Array}

#: Value columns of SQLite's lg_batch view (migration 8), after its ``kind``.
_BATCH_WIDTH = 9
#: Rows per lg_batch statement at most: 32766 is SQLite's default limit of bound parameters.
_BATCH_ROWS = 32766 // (1 + _BATCH_WIDTH)


class BatchInsert:
    """An INSERT that group commit applies to many rows at once.

    Usually the whole batch is one statement (``Statements.batch``: ``moorage_lg_write`` on PostgreSQL
    through ``fn_args``; on SQLite ``sqlite_rows``, or ``lg_batch`` through ``kind``). Inside a transaction
    (a caller's, or a SQLite batch with values for the blob log): on SQLite ``sqlite`` (one row per
    execution) through ``executemany``; on PostgreSQL ``pg_batch``, one statement for the batch whose
    parameters are one binary array per column, unnested into rows (one Bind/Execute and one plan per
    table).
    """

    __slots__ = ("sqlite", "pg_batch", "key", "fn_args", "kind", "_arrays", "_width", "_head", "_conflict", "_multi")

    def __init__(self, table: str, cols: str, types: Sequence[str], conflict: str, key: int = 0,
                 fn_prefix: str = "", kind: int | None = None) -> None:
        self._arrays = tuple(_ARRAY_TYPES[t] for t in types)
        self._width = len(types)
        self._head = f"INSERT INTO {table} ({cols}) VALUES "
        self._conflict = conflict
        self._multi: dict[int, str] = {}
        self.sqlite = self.sqlite_rows(1)
        arrays = ", ".join(f"%b::{t}[]" for t in types)
        self.pg_batch = f"INSERT INTO {table} ({cols}) SELECT * FROM unnest({arrays}) {conflict}"
        #: DO UPDATE may not touch a row twice in one statement: rows sharing their first ``key``
        #: columns (the conflict key) are reduced to the last one. 0: DO NOTHING, duplicates are fine.
        self.key = key
        #: The ``moorage_lg_write`` arguments (migration 5) taking this statement's columns, with casts.
        names = [c.strip() for c in cols.split(",")]
        self.fn_args = tuple(f"{fn_prefix}_{_FN_NAMES.get(n, n)} => %b::{t}[]" for n, t in zip(names, types)) if fn_prefix else ()
        #: The ``lg_batch`` row kind that applies this statement on SQLite (migration 8), if any.
        self.kind = kind
        assert kind is None or len(types) <= _BATCH_WIDTH

    def dedupe(self, rows: Sequence[tuple]) -> Sequence[tuple]:
        if not self.key or len(rows) < 2:
            return rows
        last = {r[: self.key]: r for r in rows}
        return rows if len(last) == len(rows) else list(last.values())

    def sqlite_rows(self, n: int) -> str:
        """SQLite: ``n`` rows in one INSERT (same conflict rule as ``sqlite``, applied row after row)."""
        sql = self._multi.get(n)
        if sql is None:
            row = "(" + ", ".join("?" * self._width) + ")"
            sql = self._multi[n] = self._head + ", ".join([row] * n) + " " + self._conflict
        return sql

    def columns(self, rows: Sequence[tuple]) -> list[list[Any]]:
        """The rows as one binary array per column (the ``pg_batch`` parameters)."""
        return [arr(col) for arr, col in zip(self._arrays, zip(*self.dedupe(rows)))]


class Statements:
    def __init__(self, dialect: str) -> None:
        tpk = "tenant_id, " if dialect == "postgres" else ""
        self.select_checkpoint = "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_id, type, checkpoint, metadata FROM lg_checkpoints"
        self.dialect = dialect
        self.insert_blob = BatchInsert("lg_blobs", _BLOB_COLS, _BLOB_TYPES, "ON CONFLICT DO NOTHING", fn_prefix="b", kind=1)
        self.upsert_checkpoint = BatchInsert(
            "lg_checkpoints", _CHECKPOINT_COLS, _CHECKPOINT_TYPES,
            f"ON CONFLICT ({tpk}thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET parent_id = excluded.parent_id, "
            "run_id = excluded.run_id, type = excluded.type, checkpoint = excluded.checkpoint, metadata = excluded.metadata, "
            "versions = excluded.versions",
            key=3, fn_prefix="c", kind=0,
        )
        self.insert_write = BatchInsert("lg_writes", _WRITE_COLS, _WRITE_TYPES, "ON CONFLICT DO NOTHING", fn_prefix="w",
                                        kind=2)
        self.upsert_write = BatchInsert(
            "lg_writes", _WRITE_COLS, _WRITE_TYPES,
            f"ON CONFLICT ({tpk}thread_id, checkpoint_ns, checkpoint_id, task_id, idx) DO UPDATE SET "
            "channel = excluded.channel, type = excluded.type, blob = excluded.blob, task_path = excluded.task_path",
            key=5, fn_prefix="u", kind=3,
        )
        self._batch_sql: dict[int, str] = {}
        # One checkpoint with its channel blobs and pending writes in one statement (one snapshot, one
        # round trip). Rows: kind 0 = the checkpoint (id, parent, metadata, type, blob, -, versions),
        # kind 1 = a channel blob (channel, -, -, type, blob), kind 2 = a pending write (task_id,
        # channel, task_path, type, blob, idx). Blobs join through the ``versions`` JSON (migration 4).
        #: PostgreSQL: migration 9's function, parameters (tenant, thread_id, checkpoint_ns, checkpoint_id or
        #: None for the latest). ``get_call`` for ``Backend.tenant_call`` (which passes the tenant first),
        #: ``get_in_tx`` inside a caller's transaction.
        self.get_call = "SELECT * FROM moorage_lg_get(%s, %s, %s, %s)"
        self.get_in_tx = "SELECT * FROM moorage_lg_get(?, ?, ?, ?)"
        # SQLite: the same rows from one query. CROSS JOIN: SQLite keeps this join order, so each (channel,
        # version) is one primary-key seek instead of a scan of the thread's blobs probed against the map.
        tail = (
            "SELECT 0, checkpoint_id, parent_id, metadata, type, checkpoint, CAST(NULL AS INTEGER), versions FROM cp "
            "UNION ALL "
            "SELECT 1, b.channel, NULL, NULL, b.type, b.blob, NULL, NULL FROM cp "
            "CROSS JOIN json_each(cp.versions) AS j CROSS JOIN lg_blobs b "
            "WHERE b.thread_id = cp.thread_id AND b.checkpoint_ns = cp.checkpoint_ns "
            "AND b.channel = j.key AND b.version = j.value "
            "UNION ALL "
            "SELECT 2, w.task_id, w.channel, w.task_path, w.type, w.blob, w.idx, NULL FROM cp "
            "JOIN lg_writes w ON w.thread_id = cp.thread_id AND w.checkpoint_ns = cp.checkpoint_ns "
            "AND w.checkpoint_id = cp.checkpoint_id"
        )
        head = ("WITH cp AS (SELECT thread_id, checkpoint_ns, checkpoint_id, parent_id, type, checkpoint, metadata, "
                "versions FROM lg_checkpoints WHERE thread_id = ? AND checkpoint_ns = ? ")
        #: SQLite, parameters (thread_id, checkpoint_ns).
        self.get_latest = head + "ORDER BY checkpoint_id DESC LIMIT 1) " + tail
        #: SQLite, parameters (thread_id, checkpoint_ns, checkpoint_id).
        self.get_by_id = head + "AND checkpoint_id = ?) " + tail
        # A page of ``list``: its checkpoints with their channel blobs and pending writes, as rows of one
        # statement (one snapshot, one round trip). Rows: (kind, thread_id, checkpoint_ns, checkpoint_id, a, b, c,
        # type, blob, idx, versions) where kind 0 is a checkpoint (a = parent_id, b = metadata, idx = its place in
        # the page's order on PostgreSQL, counted by the server so that the database's collation decides; NULL on
        # SQLite, versions = its channel -> version map), 1 a channel blob (a = channel, b = version; no
        # checkpoint_id: each blob the page's checkpoints refer to comes once, however many refer to it: a
        # channel that did not change is shared by consecutive checkpoints), 2 a pending write (a = task_id,
        # b = channel, c = task_path). In the template, ``{where}`` picks the page (its predicates, order and
        # LIMIT) and ``{cp}`` restricts a branch's ``cp`` to the page.
        order = "checkpoint_id DESC, thread_id DESC, checkpoint_ns DESC"
        head = ("0, cp.thread_id, cp.checkpoint_ns, cp.checkpoint_id, cp.parent_id, cp.metadata, CAST(NULL AS TEXT), "
                "cp.type, cp.checkpoint, CAST({n} AS INTEGER), cp.versions")
        if dialect == "postgres":
            # The page is a CTE (materialised: PostgreSQL keeps large values as TOAST pointers until output).
            self._list_page = (f"WITH cp AS (SELECT {_LIST_COLS}, row_number() OVER (ORDER BY {order}) AS n "
                               "FROM lg_checkpoints{where}) "
                               f"SELECT {head.format(n='cp.n')} FROM cp UNION ALL "
                               "SELECT 1, d.t, d.ns, NULL, b.channel, d.v, NULL, b.type, b.blob, NULL, NULL FROM "
                               "(SELECT DISTINCT cp.thread_id AS t, cp.checkpoint_ns AS ns, j.key AS ch, j.value AS v "
                               "FROM cp CROSS JOIN LATERAL jsonb_each_text(cp.versions::jsonb) AS j) AS d "
                               "CROSS JOIN LATERAL (SELECT x.channel, x.type, x.blob FROM lg_blobs x "
                               "WHERE x.thread_id = d.t AND x.checkpoint_ns = d.ns AND x.channel = d.ch "
                               "AND x.version = d.v LIMIT 1) AS b UNION ALL ")
            self._list_cp, table = "", "cp"
        else:
            # SQLite sorts whole rows, values included, when the order is not the key's (a thread's checkpoints
            # across namespaces), and a CTE of whole rows is copied (materialised) or read once per branch: the
            # page is a CTE of rowids picked through the key index, and each branch reads only the columns
            # it needs (64 checkpoints of 16 KiB: 662 -> 271 µs; a thread's 64 of 200 across namespaces,
            # 1 KiB: 570 -> 125 µs for the checkpoint rows).
            # SQLite compares text as UTF-8 bytes, which is Python's order: the caller sorts (a row number
            # here cost ~12% of the page's time).
            self._list_page = ("WITH k AS MATERIALIZED (SELECT rowid AS r FROM lg_checkpoints{where}) "
                               f"SELECT {head.format(n='NULL')} FROM lg_checkpoints cp WHERE cp.rowid IN (SELECT r FROM k) "
                               "UNION ALL "
                               "SELECT 1, d.t, d.ns, NULL, b.channel, d.v, NULL, b.type, b.blob, NULL, NULL FROM "
                               "(SELECT DISTINCT cp.thread_id AS t, cp.checkpoint_ns AS ns, j.key AS ch, j.value AS v "
                               "FROM lg_checkpoints cp CROSS JOIN json_each(cp.versions) AS j "
                               "WHERE cp.rowid IN (SELECT r FROM k)) AS d "
                               "CROSS JOIN lg_blobs b WHERE b.thread_id = d.t AND b.checkpoint_ns = d.ns "
                               "AND b.channel = d.ch AND b.version = d.v UNION ALL ")
            self._list_cp, table = " WHERE cp.rowid IN (SELECT r FROM k)", "lg_checkpoints cp"
        self._list_page += ("SELECT 2, cp.thread_id, cp.checkpoint_ns, cp.checkpoint_id, w.task_id, w.channel, w.task_path, "
                            f"w.type, w.blob, w.idx, NULL FROM {table} JOIN lg_writes w ON w.thread_id = cp.thread_id "
                            "AND w.checkpoint_ns = cp.checkpoint_ns AND w.checkpoint_id = cp.checkpoint_id{cp}")
        self._list_order = order
        self.delete_thread = tuple(f"DELETE FROM {t} WHERE thread_id = ?" for t in ("lg_writes", "lg_blobs", "lg_checkpoints"))
        # Parameters (target, source); the SELECT sees only this tenant's rows on either backend.
        self.copy_thread = (
            f"INSERT INTO lg_checkpoints ({_CHECKPOINT_COLS}) SELECT CAST(? AS TEXT), "
            "checkpoint_ns, checkpoint_id, parent_id, run_id, type, checkpoint, metadata, versions FROM lg_checkpoints "
            "WHERE thread_id = ?",
            f"INSERT INTO lg_blobs ({_BLOB_COLS}) SELECT CAST(? AS TEXT), checkpoint_ns, channel, version, type, blob "
            "FROM lg_blobs WHERE thread_id = ?",
            f"INSERT INTO lg_writes ({_WRITE_COLS}) SELECT CAST(? AS TEXT), checkpoint_ns, checkpoint_id, task_id, idx, "
            "channel, type, blob, task_path FROM lg_writes WHERE thread_id = ?",
        )

    def list_page(self, where: Sequence[str]) -> str:
        """One page of ``list``: checkpoints matching every predicate of ``where`` (``?`` placeholders), newest
        first, at most the statement's last parameter, with their blobs and writes (rows as documented above)."""
        cond = (" WHERE " + " AND ".join(where) if where else "") + f" ORDER BY {self._list_order} LIMIT ?"
        return self._list_page.format(where=cond, cp=self._list_cp)

    def batch(self, todo: Sequence[tuple[Any, Sequence[tuple]]]) -> tuple[str, list[Any]] | None:
        """A whole group-committed batch as one statement for ``Backend.tenant_call``, or None where it
        cannot be one (a statement that is not a ``BatchInsert``, or too many rows).

        PostgreSQL: one ``moorage_lg_write`` call (migration 5), one binary array per column; it takes the
        tenant as its first parameter. SQLite: rows for one table are one plain multi-row INSERT into it;
        rows for several tables one multi-row INSERT into ``lg_batch`` (migration 8), whose triggers route
        each row by its kind, its row count rounded up to a power of two with padding rows (kind NULL,
        ignored) so a handful of statements stay in the connection's statement cache.
        """
        if self.dialect == "postgres":
            if not all(isinstance(spec, BatchInsert) and spec.fn_args for spec, _ in todo):
                return None
            args: list[str] = []
            params: list[Any] = []
            for spec, rows in todo:
                args += spec.fn_args
                params += spec.columns(rows)
            return f"SELECT moorage_lg_write(%s, {', '.join(args)})", params
        n = 0
        for spec, rows in todo:
            if not isinstance(spec, BatchInsert) or spec.kind is None:
                return None
            n += len(rows)
        if not 0 < n <= _BATCH_ROWS:
            return None
        if len(todo) == 1:
            # One table: a plain multi-row INSERT. Through the view, SQLite first copies every row into a
            # temporary table (it does for any INSERT that fires row triggers), which cost ~20% more CPU per
            # batch of 16 KiB rows than inserting them directly.
            spec, rows = todo[0]
            rows = spec.dedupe(rows)
            return spec.sqlite_rows(len(rows)), [v for row in rows for v in row]
        flat: list[Any] = []
        for spec, rows in todo:
            for row in rows:
                flat.append(spec.kind)
                flat += row
                flat += (None,) * (_BATCH_WIDTH - len(row))
        size = min(1 << (n - 1).bit_length(), _BATCH_ROWS)
        flat += (None,) * ((size - n) * (1 + _BATCH_WIDTH))
        sql = self._batch_sql.get(size)
        if sql is None:
            row = "(" + ", ".join("?" * (1 + _BATCH_WIDTH)) + ")"
            cols = ", ".join(["kind"] + [f"c{i}" for i in range(1, _BATCH_WIDTH + 1)])
            sql = self._batch_sql[size] = f"INSERT INTO lg_batch ({cols}) VALUES " + ", ".join([row] * size)
        return sql, flat


def metadata_predicates(dialect: str, wanted: dict[str, Any]) -> tuple[list[str], list[Any], dict[str, Any]]:
    """SQL predicates for a ``list(filter=...)`` on checkpoint metadata, plus the part left to check in Python.

    PostgreSQL answers the whole filter with JSONB containment. SQLite's ``json_extract`` cannot tell a
    missing key from null, nor compare objects, so those keys are checked in Python on the fetched rows.
    """
    if not wanted:
        return [], [], {}
    if dialect == "postgres":
        return ["metadata::jsonb @> ?::jsonb"], [json.dumps(wanted, separators=(",", ":"))], {}
    preds: list[str] = []
    params: list[Any] = []
    rest: dict[str, Any] = {}
    for key, value in wanted.items():
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and _PLAIN_KEY.fullmatch(key):
            preds.append("json_extract(metadata, ?) = ?")
            params += [f'$."{key}"', value]
        else:
            rest[key] = value
    return preds, params, rest
