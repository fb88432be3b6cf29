"""The LangGraph checkpointer's thread verbs: delete a thread or a run's checkpoints, copy a thread, prune a thread to
its latest checkpoint (with the ancestors its delta channels need), and drop blobs nothing refers to any more."""

from __future__ import annotations

import json
from typing import Sequence

from langgraph.checkpoint.serde.base import SerializerProtocol

from moorage.errors import ConflictError, InvalidInput
from moorage.store.bloblog import LOGGED, BlobLog, live_locators
from moorage.store.langgraph_rows import _bytes
from moorage.store.langgraph_sql import Statements
from moorage.store.sql import Conn
from moorage.store.tenant import TenantStore

_PRUNE_STRATEGIES = ("keep_latest", "delete")


class ThreadVerbs:
    """The thread verbs of ``MoorageSaver`` (a mixin: the saver holds the state named below; ``_append`` and
    ``_release`` are ``Writing``'s)."""

    serde: SerializerProtocol
    _ts: TenantStore
    _sql: Statements
    _blobs: BlobLog | None

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
