"""A LangGraph checkpointer on the moorage store: checkpoints, channel blobs and pending writes in tenant tables.

``MoorageSaver(ts)`` gives an unchanged LangGraph graph moorage's tenant isolation and durability. Its writes are in
langgraph_write.py, its reads in langgraph_read.py, its thread verbs (delete, copy, prune) in langgraph_threads.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from moorage.store.langgraph_commit import GroupCommit
from moorage.store.langgraph_read import Reading
from moorage.store.langgraph_sql import Statements
from moorage.store.langgraph_threads import ThreadVerbs
from moorage.store.langgraph_write import Writing
from moorage.store.tenant import TenantStore


class MoorageSaver(Reading, Writing, ThreadVerbs, BaseCheckpointSaver[int]):
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

__all__ = ["MoorageSaver"]
