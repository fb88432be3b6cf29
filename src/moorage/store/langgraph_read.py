"""The LangGraph checkpointer's reads: one checkpoint with its channel values and pending writes in one statement,
and listings page by page; values held in the tenant's blob log are read back from it."""

from __future__ import annotations

import json
from typing import Any, Iterator

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple, get_checkpoint_id
from langgraph.checkpoint.serde.base import SerializerProtocol

from moorage.store.bloblog import LOG_TYPE as _LOG
from moorage.store.bloblog import BlobGone, BlobLog
from moorage.store.langgraph_rows import _EMPTY, _bytes, _damaged, _thread
from moorage.store.langgraph_sql import Statements, metadata_predicates
from moorage.store.sql import Conn
from moorage.store.tenant import TenantStore


class Reading:
    """The reads of ``MoorageSaver`` (a mixin: the saver holds the state named below)."""

    serde: SerializerProtocol
    _ts: TenantStore
    _sql: Statements
    _blobs: BlobLog | None
    _page_size: int

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


def _matches(md: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(k in md and md[k] == v for k, v in wanted.items())
