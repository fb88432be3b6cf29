"""The LangGraph checkpointer's writes: a checkpoint's and a task's pending writes' rows (small values inline, large
ones as blobs or in the tenant's blob log), handed to group commit; the blob log's append and release."""

from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from moorage.errors import InvalidInput
from moorage.store.bloblog import LOG_TYPE as _LOG
from moorage.store.bloblog import BlobLog, load_position, store_position
from moorage.store.langgraph_commit import GroupCommit
from moorage.store.langgraph_rows import _EMPTY, _thread
from moorage.store.langgraph_sql import Statements
from moorage.store.sql import Conn
from moorage.store.tenant import TenantStore

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


class Writing:
    """The writes of ``MoorageSaver`` (a mixin: the saver holds the state named below)."""

    serde: SerializerProtocol
    _ts: TenantStore
    _sql: Statements
    _blobs: BlobLog | None
    _log_min: int
    _commits: GroupCommit
    _inline_max: int
    _inline_total: int
    _stored: dict[tuple[str, str, str, str], None]


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
