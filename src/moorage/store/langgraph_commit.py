"""Group commit for ``MoorageSaver``: concurrent writers of one tenant share a transaction and its fsync.

A caller's write is acknowledged only after the transaction holding it committed, so durability is unchanged.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from moorage.store.tenant import TenantStore

#: One write: statement -> parameter rows, applied with executemany.
Ops = Sequence[tuple[str, Sequence[tuple]]]


class _Job:
    __slots__ = ("ops", "done", "error")

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.done = False
        self.error: BaseException | None = None


def _apply(c: Any, jobs: Sequence[_Job], pipelined: bool = False) -> None:
    # Rows of the same statement from every job go in one executemany (one round trip on PostgreSQL).
    # Reordering across statements is safe: blob inserts are idempotent per (channel, version), and
    # every other statement keys its rows by checkpoint, so the committed result is the same.
    merged: dict[str, list[tuple]] = {}
    for job in jobs:
        for sql, rows in job.ops:
            merged.setdefault(sql, []).extend(rows)
    todo = [(sql, rows) for sql, rows in merged.items() if rows]
    if c.dialect == "postgres" and len(todo) > 1 and not pipelined:
        # One round trip for all statements instead of one each; errors still surface before COMMIT.
        with c.raw.pipeline():
            for sql, rows in todo:
                c.many(sql, rows)
        return
    for sql, rows in todo:
        c.many(sql, rows)


class GroupCommit:
    """Leader/follower batching: whoever finds a free commit slot leads and commits everything queued.

    While one transaction commits, later writers queue; the next leader takes them all in one
    transaction. A lone writer pays only an uncontended lock. If a batch fails, each job is retried in
    its own transaction so one bad write never fails its neighbours.
    """

    def __init__(self, ts: TenantStore, max_batch: int = 64, max_inflight: int | None = None) -> None:
        self._ts = ts
        self._max = max(1, max_batch)
        # SQLite serialises writers on the file lock, so one batch at a time; PostgreSQL commits
        # concurrent transactions in parallel (and merges their WAL flushes), so let a few overlap.
        self._max_inflight = max(1, max_inflight if max_inflight is not None else (4 if ts.dialect == "postgres" else 1))
        self._cv = threading.Condition()
        self._queue: list[_Job] = []
        self._inflight = 0

    def write(self, ops: Ops) -> None:
        if self._ts.ambient() is not None:
            # The caller grouped work with ``ts.transaction()``: join it, commit with it.
            with self._ts._tx() as c:
                _apply(c, [_Job(ops)])
            return
        job = _Job(ops)
        with self._cv:
            self._queue.append(job)
            while self._inflight >= self._max_inflight and not job.done:
                self._cv.wait()
            if job.done:
                return self._outcome(job)
            self._inflight += 1
        try:
            while not job.done:
                with self._cv:
                    batch = self._queue[: self._max]
                    del self._queue[: self._max]
                if not batch:
                    # Another leader took our job and is committing it: wait for that commit.
                    with self._cv:
                        while not job.done:
                            self._cv.wait()
                    break
                self._commit(batch)
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
        return self._outcome(job)

    @staticmethod
    def _outcome(job: _Job) -> None:
        if job.error is not None:
            raise job.error

    def _run(self, jobs: Sequence[_Job]) -> None:
        """Apply ``jobs`` in one transaction of their own and commit it.

        On PostgreSQL the transaction runs pipelined: BEGIN, the tenant setting, every statement and
        COMMIT reach the server in one round trip. Writes read nothing back, so nothing waits in
        between; a failure surfaces at the commit and rolls the whole transaction back.
        """
        if self._ts.dialect == "postgres":
            with self._ts.backend.tenant_tx(self._ts.tenant_id, pipeline=True) as c:  # type: ignore[call-arg]
                _apply(c, jobs, pipelined=True)
        else:
            with self._ts._tx() as c:
                _apply(c, jobs)

    def _commit(self, batch: list[_Job]) -> None:
        try:
            self._run(batch)
        except BaseException as e:
            if len(batch) == 1:
                batch[0].error = e
            else:
                for job in batch:
                    try:
                        self._run([job])
                    except BaseException as one:  # handed to that job's caller, re-raised in its thread
                        job.error = one
        with self._cv:
            for job in batch:
                job.done = True
            self._cv.notify_all()
