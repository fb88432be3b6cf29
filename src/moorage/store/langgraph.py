"""A LangGraph checkpointer on the moorage store: checkpoints, channel blobs and pending writes in tenant tables.

``MoorageSaver(ts)`` gives an unchanged LangGraph graph moorage's tenant isolation and durability.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Iterator, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from moorage.errors import ConflictError, InvalidInput, UnavailableError
from moorage.store.bloblog import LOG_TYPE as _LOG
from moorage.store.bloblog import LOGGED, BlobGone, live_locators, load_position, store_position
from moorage.store.langgraph_commit import GroupCommit
from moorage.store.langgraph_sql import Statements, metadata_predicates
from moorage.store.sql import Conn
from moorage.store.tenant import TenantStore

# Marks a channel that has a version but no value at that checkpoint (e.g. a DeltaChannel step
# between snapshots): a row is written so the version is known, and it is skipped on load.
_EMPTY = "empty"
_PRUNE_STRATEGIES = ("keep_latest", "delete")
# Serialised types that can be embedded in the checkpoint's own msgpack and come back unchanged.
_INLINE_TYPES = ("msgpack", "null")
# Bound on the memo of blobs a saver knows are stored (entries are small tuples).
_STORED_MAX = 65536


class _Spill:
    """A large value on its way to the blob log: the group-commit leader appends it and puts the locator
    in its row (``MoorageSaver._spill``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _thread(config: RunnableConfig) -> tuple[str, str]:
    conf = config.get("configurable") or {}
    if conf.get("thread_id") is None:
        raise InvalidInput(
            "a LangGraph config needs configurable.thread_id",
            hint='invoke the graph with config={"configurable": {"thread_id": "..."}}',
        )
    return str(conf["thread_id"]), str(conf.get("checkpoint_ns") or "")


# One encoder each, built once: ``json.dumps`` with options builds a new encoder on every call.
_METADATA_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_VERSIONS_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _metadata_json(md: dict[str, Any]) -> str:
    try:
        return _METADATA_JSON.encode(md)
    except (TypeError, ValueError) as e:
        raise InvalidInput(
            f"checkpoint metadata is not JSON-serialisable: {e}",
            hint="keep values in config['metadata'] to strings, numbers, booleans, lists and dicts",
        ) from e


def _bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else bytes(v)


class MoorageSaver(BaseCheckpointSaver[int]):
    """LangGraph ``BaseCheckpointSaver`` storing one tenant's threads in the moorage store.

    Every call runs in a store transaction (``ts._tx``) and returns after it committed, so an
    acknowledged ``put`` is as durable as the store itself; concurrent writes share transactions
    (group commit). The ``a*`` variants run the same code in a worker thread. Thread ids come from
    the graph's config but the tenant never does: it is the ``TenantStore``'s authenticated principal.
    """

    def __init__(self, ts: TenantStore, *, serde: SerializerProtocol | None = None, page_size: int = 64,
                 max_batch: int = 64, inline_max: int = 4096, inline_total: int = 16384,
                 log_min: int = 16384) -> None:
        super().__init__(serde=serde)
        if not isinstance(ts, TenantStore):
            raise TypeError("MoorageSaver needs a TenantStore from Store.tenant(principal)")
        self._ts = ts
        self._sql = Statements(ts.dialect)
        self._page_size = max(1, page_size)
        # Where the backend has one (SQLite files), values of at least ``log_min`` serialised bytes go to the
        # tenant's blob log, written once instead of twice (WAL, then database file); see bloblog.py.
        # ``log_min=0`` keeps every value in rows. Rows already in the log stay readable either way.
        self._blobs = ts.backend.blob_log(ts.tenant_id)
        self._log_min = log_min if log_min > 0 and self._blobs is not None else 0
        # Concurrent put/put_writes calls (many graphs, or async tasks) share transactions; see GroupCommit.
        self._commits = GroupCommit(ts, max_batch, prepare=self._spill if self._log_min else None,
                                    single=self._one_statement)
        # A channel value whose serialised form is at most ``inline_max`` bytes is stored inside the
        # checkpoint row, up to ``inline_total`` bytes per checkpoint; larger ones go to lg_blobs once
        # per version. ``inline_max=0`` stores every value as a blob (the layout before inlining).
        # A step that rewrote every value (nothing would be shared with the next checkpoint anyway)
        # inlines values up to twice those limits: the whole state in one row, as the official savers
        # store it. A step that changed part of the state keeps the smaller limits, so unchanged values
        # are not copied into every later checkpoint.
        self._inline_max = max(0, inline_max)
        self._inline_total = max(0, inline_total)
        # (thread, ns, channel, version) of blobs this saver has committed: unchanged large values are
        # then referenced without being serialised again. Only ever an optimisation: a miss re-sends
        # the blob, which the insert ignores if it is already there.
        self._stored: dict[tuple[str, str, str, str], None] = {}

    @property
    def tenant_store(self) -> TenantStore:
        return self._ts

    # -- writing ----------------------------------------------------------------------------------

    def put(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> RunnableConfig:
        ops, fresh, out = self._put_ops(config, checkpoint, metadata, new_versions)
        self._commits.write(ops)
        self._remember(fresh)
        return out

    def _put_ops(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> tuple[list[tuple[Any, list[tuple]]], list[tuple], RunnableConfig]:
        """A put's statements and rows (for group commit), the blob keys it writes, and the config it returns."""
        thread_id, ns = _thread(config)
        parent_id = get_checkpoint_id(config)
        values = checkpoint["channel_values"]
        dumps = self.serde.dumps_typed
        # Small channel values travel inline in the checkpoint row (one row written and read per step);
        # the others go to lg_blobs keyed by (channel, version), written once per version.
        inline: dict[str, Any] = {}
        rewrite = len(new_versions) >= len(values) and all(ch in new_versions for ch in values)
        limit = self._inline_max * (2 if rewrite else 1)
        budget = self._inline_total * (2 if rewrite else 1)
        blobs = []
        refs: dict[str, str] = {}
        stored = self._stored
        fresh: list[tuple] = []
        for channel, version in checkpoint["channel_versions"].items():
            sv = str(version)
            if channel in values:
                key = (thread_id, ns, channel, sv)
                if key in stored and channel not in new_versions:
                    refs[channel] = sv  # this saver wrote (or confirmed) that blob: skip serialising it again
                    continue
                value = values[channel]
                vt, vb = dumps(value)
                if vt in _INLINE_TYPES and len(vb) <= limit and len(vb) <= budget:
                    inline[channel] = value
                    budget -= len(vb)
                    continue
                # Written even when the version is not new (insert-or-ignore): an earlier checkpoint may
                # have held this value inline, so a blob for this version need not exist yet.
                if self._log_min and len(vb) >= self._log_min:
                    blobs.append((thread_id, ns, channel, sv, _LOG + vt, _Spill(vb)))
                else:
                    blobs.append((thread_id, ns, channel, sv, vt, vb))
                fresh.append(key)
                refs[channel] = sv
            elif channel in new_versions:
                blobs.append((thread_id, ns, channel, sv, _EMPTY, None))
                refs[channel] = sv
            else:
                refs[channel] = sv
        head = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        head["channel_values"] = inline
        cp_type, cp_blob = dumps(head)
        md = get_serializable_checkpoint_metadata(config, metadata)
        run_id = md.get("run_id")
        # The blob-held channels' versions as lg_blobs keys them (strings), so get_tuple joins blobs in SQL
        # (migration 4). Inline channels are not in it: their values are in the checkpoint itself.
        versions = _VERSIONS_JSON.encode(refs)
        row = (thread_id, ns, checkpoint["id"], parent_id, None if run_id is None else str(run_id), cp_type, cp_blob,
               _metadata_json(md), versions)
        ops = [(self._sql.insert_blob, blobs), (self._sql.upsert_checkpoint, [row])] if blobs else \
            [(self._sql.upsert_checkpoint, [row])]
        return ops, fresh, {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    def _remember(self, fresh: list[tuple]) -> None:
        """Note blobs this saver has committed, so later puts need not serialise those values again."""
        if fresh:
            stored = self._stored
            if len(stored) > _STORED_MAX:
                stored.clear()
            stored.update(dict.fromkeys(fresh))

    def _spill_column(self, sql: Any) -> int | None:
        """The column of ``sql``'s rows that may hold a value for the blob log (a ``_Spill``), or None."""
        if sql is self._sql.insert_blob:
            return 5
        if sql is self._sql.insert_write or sql is self._sql.upsert_write:
            return 7
        return None

    def _spill(self, c: Conn, todo: list[tuple[Any, list[tuple]]]) -> None:
        """GroupCommit's ``prepare``, inside the write transaction: append the batch's spilled values (channel
        values and pending writes) to the blob log in one write and one fdatasync, and put their locators in
        the rows about to be inserted."""
        at = self._spilled(todo)
        if at:
            locs = self._append(c, [rows[i][col].data for rows, i, col in at])
            for (rows, i, col), loc in zip(at, locs):
                rows[i] = rows[i][:col] + (loc,) + rows[i][col + 1:]

    def _spilled(self, todo: list[tuple[Any, list[tuple]]]) -> list[tuple[list[tuple], int, int]]:
        """Where the batch holds values for the blob log: (rows, row index, column) of each ``_Spill``."""
        at: list[tuple[list[tuple], int, int]] = []
        if self._log_min:
            for sql, rows in todo:
                col = self._spill_column(sql)
                if col is not None:
                    at += [(rows, i, col) for i, r in enumerate(rows) if isinstance(r[col], _Spill)]
        return at

    def _one_statement(self, todo: list[tuple[Any, list[tuple]]]) -> tuple[str, list[Any]] | None:
        """GroupCommit's ``single``: the batch as one statement, unless it holds values for the blob log
        (those are appended under the transaction's write lock first, see ``_spill``)."""
        return None if self._spilled(todo) else self._sql.batch(todo)

    def _append(self, c: Conn, values: list[bytes]) -> list[bytes]:
        """Append to the blob log at its recorded end and advance that end in the same transaction."""
        locs, end = self._blobs.append(values, load_position(c))  # type: ignore[union-attr]
        store_position(c, end)
        return locs

    def _release(self, locs: list[bytes]) -> None:
        """Punch deleted values out of the blob log, once their delete has committed. Inside a caller's
        transaction that might still roll back they are left for the next vacuum."""
        # Deleted blobs leave the memo too: a later put must write such a version again, not refer to it.
        self._stored.clear()
        if locs and self._blobs is not None and self._ts.ambient() is None:
            self._blobs.release(locs)

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = "") -> None:
        ops = self._writes_ops(config, writes, task_id, task_path)
        if ops:
            self._commits.write(ops)

    def _writes_ops(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                    task_path: str) -> list[tuple[Any, list[tuple]]]:
        """put_writes' statement and rows (none for no writes)."""
        thread_id, ns = _thread(config)
        checkpoint_id = get_checkpoint_id(config)
        if checkpoint_id is None:
            raise InvalidInput("put_writes needs configurable.checkpoint_id", hint="pass the config returned by put()")
        rows = []
        for i, (channel, value) in enumerate(writes):
            vt, vb = self.serde.dumps_typed(value)
            if self._log_min and len(vb) >= self._log_min:
                vt, vb = _LOG + vt, _Spill(vb)  # a large write goes to the blob log, as channel values do
            rows.append((thread_id, ns, checkpoint_id, task_id, WRITES_IDX_MAP.get(channel, i), channel, vt, vb, task_path))
        if not rows:
            return []
        # Special channels (error, interrupt, ...) are replaced on retry; a task's regular writes are
        # kept as first written, so replaying a task never duplicates or changes them.
        special = all(w[0] in WRITES_IDX_MAP for w in writes)
        return [(self._sql.upsert_write if special else self._sql.insert_write, rows)]

    def delete_thread(self, thread_id: str) -> None:
        with self._ts._tx() as c:
            locs = live_locators(c, str(thread_id)) if self._blobs is not None else []
            for stmt in self._sql.delete_thread:
                c.x(stmt, (str(thread_id),))
        self._release(locs)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        ids = [str(r) for r in run_ids]
        if not ids:
            return
        marks = ", ".join("?" * len(ids))
        locs: list[bytes] = []
        with self._ts._tx() as c:
            doomed = c.q(f"SELECT thread_id, checkpoint_ns, checkpoint_id FROM lg_checkpoints WHERE run_id IN ({marks})", ids)
            if not doomed:
                return
            locs += self._delete_writes(c, doomed)
            c.x(f"DELETE FROM lg_checkpoints WHERE run_id IN ({marks})", ids)
            for thread_id, ns in sorted({(r[0], r[1]) for r in doomed}):
                locs += self._drop_unreferenced_blobs(c, thread_id, ns)
        self._release(locs)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src, dst = str(source_thread_id), str(target_thread_id)
        with self._ts._tx() as c:
            if c.one("SELECT 1 FROM lg_checkpoints WHERE thread_id = ? LIMIT 1", (dst,)):
                raise ConflictError(
                    f"thread {dst!r} already has checkpoints",
                    hint="copy into a new thread id, or delete_thread() the target first",
                )
            for stmt in self._sql.copy_thread:
                c.x(stmt, (dst, src))
            self._copy_logged(c, dst)

    def _copy_logged(self, c: Conn, thread_id: str) -> None:
        """Give a copied thread its own copies of its blob-log values and pending writes (the rows were
        copied with the source's locators), so deleting either thread never punches values the other
        still uses."""
        if self._blobs is None:
            return
        for select, update in (
            (f"SELECT blob, checkpoint_ns, channel, version FROM lg_blobs WHERE thread_id = ? AND {LOGGED}",
             "UPDATE lg_blobs SET blob = ? WHERE thread_id = ? AND checkpoint_ns = ? AND channel = ? AND version = ?"),
            ("SELECT blob, checkpoint_ns, checkpoint_id, task_id, idx FROM lg_writes WHERE thread_id = ? "
             f"AND {LOGGED}",
             "UPDATE lg_writes SET blob = ? WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ? "
             "AND task_id = ? AND idx = ?"),
        ):
            rows = c.q(select, (thread_id,))
            for i in range(0, len(rows), 64):
                part = rows[i: i + 64]
                locs = self._append(c, [self._blobs.read(r[0]) for r in part])
                c.many(update, [(loc, thread_id, *r[1:]) for loc, r in zip(locs, part)])

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        if strategy not in _PRUNE_STRATEGIES:
            raise InvalidInput(f"unknown prune strategy {strategy!r}", hint=f"one of {', '.join(_PRUNE_STRATEGIES)}")
        for tid in thread_ids:
            if strategy == "delete":
                self.delete_thread(tid)
            else:
                self._keep_latest(str(tid))

    def _keep_latest(self, thread_id: str) -> None:
        locs: list[bytes] = []
        with self._ts._tx() as c:
            rows = c.q(
                "SELECT checkpoint_ns, checkpoint_id, parent_id, metadata FROM lg_checkpoints WHERE thread_id = ? "
                "ORDER BY checkpoint_ns, checkpoint_id DESC",
                (thread_id,),
            )
            by_ns: dict[str, list[tuple]] = {}
            for r in rows:
                by_ns.setdefault(r[0], []).append(r)
            for ns, cps in by_ns.items():
                keep = self._kept_chain(cps)
                drop = [(thread_id, ns, r[1]) for r in cps if r[1] not in keep]
                if not drop:
                    continue
                locs += self._delete_writes(c, drop)
                c.many("DELETE FROM lg_checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?", drop)
                locs += self._drop_unreferenced_blobs(c, thread_id, ns)
        self._release(locs)

    @staticmethod
    def _kept_chain(cps: list[tuple]) -> set[str]:
        """The latest checkpoint, plus the ancestors its DeltaChannels still need to rebuild their values.

        ``counters_since_delta_snapshot[ch][1]`` counts the supersteps since ``ch``'s last snapshot, so
        keeping that many parents (and their writes) keeps every delta channel reconstructible.
        """
        latest = cps[0]
        counters = json.loads(latest[3]).get("counters_since_delta_snapshot") or {}
        depth = max((int(v[1]) for v in counters.values() if isinstance(v, (list, tuple)) and len(v) > 1), default=0)
        parents = {r[1]: r[2] for r in cps}
        keep, cur = {latest[1]}, latest[2]
        # One extra ancestor: the snapshot itself sits at the end of the counted supersteps.
        n = depth + 1 if depth else 0
        while n > 0 and cur is not None and cur in parents:
            keep.add(cur)
            cur = parents[cur]
            n -= 1
        return keep

    def _delete_writes(self, c: Conn, keys: Sequence[tuple]) -> list[bytes]:
        """Delete the pending writes of these (thread, namespace, checkpoint) keys; returns the blob-log
        locators among them, for ``_release`` once this transaction committed."""
        locs: list[bytes] = []
        if self._blobs is not None:
            # One read per (thread, namespace), not per checkpoint (a logged write's blob is its locator: small).
            doomed: dict[tuple[str, str], set[str]] = {}
            for thread_id, ns, checkpoint_id in keys:
                doomed.setdefault((thread_id, ns), set()).add(checkpoint_id)
            for (thread_id, ns), ids in doomed.items():
                locs += [r[1] for r in c.q(
                    f"SELECT checkpoint_id, blob FROM lg_writes WHERE thread_id = ? AND checkpoint_ns = ? AND {LOGGED}",
                    (thread_id, ns)) if r[0] in ids]
        c.many("DELETE FROM lg_writes WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?", keys)
        return locs

    def _drop_unreferenced_blobs(self, c: Conn, thread_id: str, ns: str) -> list[bytes]:
        """Delete channel blobs no remaining checkpoint of (thread, namespace) refers to; returns the blob-log
        locators among them, for ``_release`` once this transaction committed."""
        live: set[tuple[str, str]] = set()
        for t, b in c.q("SELECT type, checkpoint FROM lg_checkpoints WHERE thread_id = ? AND checkpoint_ns = ?", (thread_id, ns)):
            head = self.serde.loads_typed((t, _bytes(b)))
            live.update((ch, str(v)) for ch, v in head.get("channel_versions", {}).items())
        stored = c.q(f"SELECT channel, version, CASE WHEN {LOGGED} THEN blob END FROM lg_blobs "
                     "WHERE thread_id = ? AND checkpoint_ns = ?", (thread_id, ns))
        dead = [(ch, v, loc) for ch, v, loc in stored if (ch, v) not in live]
        if dead:
            c.many("DELETE FROM lg_blobs WHERE thread_id = ? AND checkpoint_ns = ? AND channel = ? AND version = ?",
                   [(thread_id, ns, ch, v) for ch, v, _ in dead])
        return [loc for _, _, loc in dead if loc is not None]

    # -- reading ----------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        try:
            return self._get_tuple(config)
        except BlobGone:
            # A delete committed between reading the rows and reading a value from the blob log: read
            # again, which sees the delete. A value still missing then is damage, reported as such.
            try:
                return self._get_tuple(config)
            except BlobGone as e:
                raise _damaged(e) from e

    def _get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id, ns = _thread(config)
        checkpoint_id = get_checkpoint_id(config)
        rows = self._checkpoint_rows(thread_id, ns, checkpoint_id)
        cp = next((r for r in rows if r[0] == 0), None)
        if cp is None:
            return None
        if cp[7] is None:
            # Written before migration 4 (no version map to join on): read it the old way.
            return self._get_tuple_slow(thread_id, ns, cp[1])
        head = self.serde.loads_typed((cp[4], _bytes(cp[5])))
        blobs = [(r[1], r[4], r[5]) for r in rows if r[0] == 1]
        # writes_sort_key order: task_path, task_id, idx.
        writes = sorted((r for r in rows if r[0] == 2), key=lambda r: (r[3], r[1], r[6]))
        row = (thread_id, ns, cp[1], cp[2], cp[4], cp[5], cp[3])
        return self._decode((row, head, blobs, [(r[1], r[2], r[4], r[5]) for r in writes]))

    def _checkpoint_rows(self, thread_id: str, ns: str, checkpoint_id: str | None) -> list[tuple]:
        """The checkpoint (the latest if no id) with its channel blobs and pending writes, as rows of one
        statement in one snapshot (see ``Statements``), inside the caller's ``ts.transaction()`` if there is one.

        SQLite: one query without BEGIN/COMMIT (``TenantStore.read``). PostgreSQL: one call of
        ``moorage_lg_get`` (migration 9), which scopes itself to the saver's tenant: through
        ``Backend.tenant_call`` it is prepared once per connection and runs without the GIL.
        """
        ts = self._ts
        if ts.dialect != "postgres":
            if checkpoint_id:
                return ts.read(self._sql.get_by_id, (thread_id, ns, checkpoint_id))
            return ts.read(self._sql.get_latest, (thread_id, ns))
        params = (thread_id, ns, checkpoint_id or None)
        ambient = ts.ambient()
        if ambient is not None:
            return ambient.q(self._sql.get_in_tx, (ts.tenant_id, *params))
        return ts.backend.tenant_call(ts.tenant_id, self._sql.get_call, params)

    def _get_tuple_slow(self, thread_id: str, ns: str, checkpoint_id: str) -> CheckpointTuple | None:
        with self._ts._tx(write=False) as c:
            row = c.one(self._sql.select_checkpoint + " WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                        (thread_id, ns, checkpoint_id))
            if row is None:
                return None
            raw = self._fetch_parts(c, row)
        return self._decode(raw)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        for page in self._pages(config, filter, before, limit):
            yield from page

    def _pages(
        self, config: RunnableConfig | None, filter: dict[str, Any] | None, before: RunnableConfig | None, limit: int | None
    ) -> Iterator[list[CheckpointTuple]]:
        """Pages of results, each read by one statement (never a transaction held open while the caller iterates)."""
        where: list[str] = []
        params: list[Any] = []
        conf = (config or {}).get("configurable") or {}
        if conf.get("thread_id") is not None:
            where.append("thread_id = ?")
            params.append(str(conf["thread_id"]))
        if conf.get("checkpoint_ns") is not None:
            where.append("checkpoint_ns = ?")
            params.append(str(conf["checkpoint_ns"]))
        if conf.get("checkpoint_id"):
            where.append("checkpoint_id = ?")
            params.append(str(conf["checkpoint_id"]))
        if before is not None and get_checkpoint_id(before):
            where.append("checkpoint_id < ?")
            params.append(get_checkpoint_id(before))
        sql_preds, sql_params, py_filter = metadata_predicates(self._ts.dialect, filter or {})
        where += sql_preds
        params += sql_params
        if limit is not None and limit <= 0:
            return
        remaining = limit
        cursor: tuple[str, str, str] | None = None
        while True:
            page_where = list(where)
            page_params = list(params)
            if cursor is not None:
                page_where.append("(checkpoint_id, thread_id, checkpoint_ns) < (?, ?, ?)")
                page_params += cursor
            size = self._page_size if remaining is None or py_filter else min(self._page_size, remaining)
            held, end, raws = self._page(page_where, (*page_params, size), py_filter)
            out = []
            for raw in raws:
                try:
                    out.append(self._decode(raw))
                except BlobGone as e:
                    # Deleted while this page was being read (then it is simply not listed), or damaged.
                    if self._ts.read("SELECT 1 FROM lg_checkpoints WHERE thread_id = ? AND checkpoint_ns = ? "
                                     "AND checkpoint_id = ?", raw[0][:3]):
                        raise _damaged(e) from e
            if remaining is not None:
                out = out[:remaining]
                remaining -= len(out)
            if out:
                yield out
            if held < size or remaining == 0 or end is None:
                return
            cursor = end

    def _page(self, where: list[str], params: tuple,
              py_filter: dict[str, Any]) -> tuple[int, tuple[str, str, str] | None, list[tuple]]:
        """One page of checkpoints (``Statements.list_page``) in one statement: how many checkpoints it held
        (before ``py_filter``), the key the next page continues below (None if it held none), and what
        ``_decode`` needs for each checkpoint that matches, newest first."""
        rows = self._ts.read(self._sql.list_page(where), params)
        cps = [r for r in rows if r[0] == 0]
        if self._ts.dialect == "postgres":
            cps.sort(key=lambda r: r[9])  # the server's order: the database's collation may not be Python's
        else:
            cps.sort(key=lambda r: (r[3], r[1], r[2]), reverse=True)
        end = (cps[-1][3], cps[-1][1], cps[-1][2]) if cps else None
        if any(r[10] is None for r in cps):
            # Written before migration 4 (no version map to join blobs on): read the page the old way.
            return self._page_slow(where, params, py_filter)
        # Channel blobs by (thread_id, checkpoint_ns, channel, version), each once per page; pending writes by
        # checkpoint. Each checkpoint decodes its own copy of a shared blob (values may be mutable).
        blobs: dict[tuple, tuple] = {}
        writes_of: dict[tuple, list[tuple]] = {}
        for r in rows:
            if r[0] == 1:
                blobs[(r[1], r[2], r[4], r[5])] = (r[4], r[7], r[8])
            elif r[0] == 2:
                writes_of.setdefault(r[1:4], []).append(r)
        raws = []
        for r in cps:
            if py_filter and not _matches(json.loads(r[5]), py_filter):
                continue
            mine = []
            if blobs and r[10] != "{}":  # "{}": every value inline
                refs = json.loads(r[10]).items()
                mine = [b for b in (blobs.get((r[1], r[2], ch, v)) for ch, v in refs) if b is not None]
            # LangGraph's writes_sort_key: task_path, task_id, idx.
            writes = sorted(writes_of.get(r[1:4], ()), key=lambda w: (w[6], w[4], w[9]))
            raws.append(((r[1], r[2], r[3], r[4], r[7], r[8], r[5]), self.serde.loads_typed((r[7], _bytes(r[8]))),
                         mine, [(w[4], w[5], w[7], w[8]) for w in writes]))
        return len(cps), end, raws

    def _page_slow(self, where: list[str], params: tuple,
                   py_filter: dict[str, Any]) -> tuple[int, tuple[str, str, str] | None, list[tuple]]:
        """``_page`` for checkpoints without a version map: the page, then each one's blobs and writes, in one
        transaction."""
        sql = (self._sql.select_checkpoint + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY checkpoint_id DESC, thread_id DESC, checkpoint_ns DESC LIMIT ?")
        with self._ts._tx(write=False) as c:
            rows = c.q(sql, params)
            raws = [self._fetch_parts(c, r) for r in rows if not py_filter or _matches(json.loads(r[6]), py_filter)]
        return len(rows), ((rows[-1][2], rows[-1][0], rows[-1][1]) if rows else None), raws

    def _fetch_parts(self, c: Conn, row: tuple) -> tuple:
        """Everything needed to rebuild one CheckpointTuple, read inside the caller's transaction."""
        thread_id, ns, checkpoint_id = row[0], row[1], row[2]
        head = self.serde.loads_typed((row[4], _bytes(row[5])))
        versions = head.get("channel_versions") or {}
        inline = head.get("channel_values") or {}
        blobs: list[tuple] = []
        pairs = [(ch, str(v)) for ch, v in versions.items() if ch not in inline]
        if pairs:
            rowvals = ", ".join(["(?, ?)"] * len(pairs))
            blobs = c.q(
                "SELECT channel, type, blob FROM lg_blobs WHERE thread_id = ? AND checkpoint_ns = ? "
                f"AND (channel, version) IN (VALUES {rowvals})",
                (thread_id, ns, *[x for p in pairs for x in p]),
            )
        writes = c.q(
            "SELECT task_id, channel, type, blob FROM lg_writes WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ? "
            "ORDER BY task_path, task_id, idx",
            (thread_id, ns, checkpoint_id),
        )
        return row, head, blobs, writes

    def _decode(self, raw: tuple) -> CheckpointTuple:
        row, head, blobs, writes = raw
        thread_id, ns, checkpoint_id, parent_id = row[0], row[1], row[2], row[3]
        # Inline values (in the checkpoint itself) plus those held in lg_blobs; rows written before
        # values were inlined have an empty inline map.
        values = head.get("channel_values")
        if not isinstance(values, dict):
            values = head["channel_values"] = {}
        for ch, t, b in blobs:
            t, b = self._logged(ch, t, b)
            if t != _EMPTY and b is not None:
                values[ch] = self.serde.loads_typed((t, b))
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}},
            checkpoint=head,
            metadata=json.loads(row[6]),
            parent_config=(
                {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent_id}}
                if parent_id else None
            ),
            pending_writes=[(tid, ch, self.serde.loads_typed(self._logged(ch, t, b))) for tid, ch, t, b in writes],
        )

    def _logged(self, channel: str, t: str, b: Any) -> tuple[str, Any]:
        """A stored (type, bytes) pair, with a value held in the blob log read back from it."""
        if not t.startswith(_LOG):
            return t, (None if b is None else _bytes(b))
        if self._blobs is None:
            raise BlobGone(f"channel {channel!r} is in a blob log this store has none of")
        return t[len(_LOG):], self._blobs.read(b)

    # -- async ----------------------------------------------------------------------------------------
    # Writes are serialised on the event loop and queued for group commit without a worker thread
    # (``GroupCommit.awrite``); everything else runs the sync code in a worker thread (each thread has
    # its own store connection).

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        pages = self._pages(config, filter, before, limit)
        done = object()
        while True:
            page = await asyncio.to_thread(next, pages, done)
            if page is done:
                return
            for item in page:  # type: ignore[union-attr]
                yield item

    async def aput(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> RunnableConfig:
        ops, fresh, out = self._put_ops(config, checkpoint, metadata, new_versions)
        await self._commits.awrite(ops)
        self._remember(fresh)
        return out

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        ops = self._writes_ops(config, writes, task_id, task_path)
        if ops:
            await self._commits.awrite(ops)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)


def _damaged(e: BlobGone) -> UnavailableError:
    return UnavailableError(
        f"a checkpoint's channel value is missing from the tenant's blob log ({e})",
        hint="the store's files were changed or damaged outside moorage; restore them from a backup",
    )


def _matches(md: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(k in md and md[k] == v for k, v in wanted.items())


__all__ = ["MoorageSaver"]
