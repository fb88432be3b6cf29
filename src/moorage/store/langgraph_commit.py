"""Group commit for ``MoorageSaver``: concurrent writers of one tenant share a transaction and its fsync.

A caller's write is acknowledged only after the transaction holding it committed, so durability is unchanged.
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
from typing import Any, Callable, Hashable, Sequence

from moorage.store.langgraph_sql import BatchInsert
from moorage.store.tenant import TenantStore

#: One write: statement -> parameter rows. A plain SQL string is applied with executemany; the rows of a
#: ``BatchInsert`` are merged across the batch (one statement per batch, see ``Single``).
Ops = Sequence[tuple[Any, Sequence[tuple]]]
#: Renders a batch's merged (statement, rows) lists as one statement and its parameters for
#: ``Backend.tenant_call``, or returns None (the batch then runs as a transaction).
Single = Callable[[list[tuple[Any, list[tuple]]]], "tuple[str, Sequence[Any]] | None"]
#: Called inside the write transaction with its connection and the batch's merged (statement, rows) lists,
#: before they are applied; may replace rows in those lists (the blob log turns spilled values into
#: locators here).
Prepare = Callable[[Any, list[tuple[Any, list[tuple]]]], None]


class _EventSignal:
    """A wake-up signal: an eventfd read (to wait) and written (to wake). A writer thread's is reused by
    every job of that thread and closed when the thread ends; each committer has its own.

    Unlike releasing a ``threading.Lock``, writing it releases the GIL around the system call: the
    woken thread often preempts its waker right there, and a waker preempted while holding the GIL
    stalls every thread until it runs again (measured: a quarter of the client's GIL time on SQLite
    1 KiB puts went to lock releases).
    """

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_SEMAPHORE)

    def acquire(self, timeout: float = -1) -> bool:
        """Wait for a ``release`` (at most ``timeout`` seconds unless negative), as ``Lock.acquire``."""
        if timeout >= 0 and not select.select([self.fd], [], [], timeout)[0]:
            return False
        os.eventfd_read(self.fd)
        return True

    def release(self) -> None:
        os.eventfd_write(self.fd, 1)

    def __del__(self) -> None:
        os.close(self.fd)


_local = threading.local()


def _held_signal() -> Any:
    """A new wake-up signal, held (``acquire`` blocks until someone calls ``release``)."""
    if not hasattr(os, "eventfd"):
        lock = threading.Lock()
        lock.acquire()
        return lock
    return _EventSignal()


def _signal() -> Any:
    """The calling thread's wake-up signal, held."""
    if not hasattr(os, "eventfd"):
        return _held_signal()
    sig = getattr(_local, "signal", None)
    if sig is None:
        sig = _local.signal = _EventSignal()
    return sig


class _Job:
    __slots__ = ("ops", "done", "leading", "error", "wake", "chain", "future")

    def __init__(self, ops: Ops, future: asyncio.Future | None = None) -> None:
        self.ops = ops
        self.done = False
        #: True while this job's own thread holds a commit slot (it is never woken by a commit).
        self.leading = False
        self.error: BaseException | None = None
        #: An async writer's (``GroupCommit.awrite``): resolved on its event loop once committed; no thread waits.
        self.future = future
        # Held until the job is committed: waiting on it wakes only this thread. Each release is matched
        # by one acquire of the job's own thread, so the signal is balanced again when the job returns
        # and the thread's next job can reuse it.
        self.wake = _signal() if future is None else None
        #: The next sleeper of the same committed batch: this job's thread wakes it once woken itself.
        self.chain: _Job | None = None

    def woken(self) -> None:
        """Called by this job's thread after its wake lock was released for a commit: pass the wake-up on."""
        nxt = self.chain
        if nxt is not None:
            self.chain = None
            nxt.wake.release()


def _settle(jobs: Sequence[_Job]) -> None:
    """On their event loop: resolve committed async jobs' futures (a cancelled waiter's is left alone)."""
    for job in jobs:
        fut = job.future
        if fut is not None and not fut.done():
            if job.error is not None:
                fut.set_exception(job.error)
            else:
                fut.set_result(None)


def _notify(jobs: Sequence[_Job]) -> None:
    """Hand committed async jobs to their event loops: one wake-up per loop and batch, not one per job."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
    for job in jobs:
        by_loop.setdefault(job.future.get_loop(), []).append(job)  # type: ignore[union-attr]
    for loop, mine in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, mine)
        except RuntimeError:  # the loop was closed meanwhile: nobody is waiting any more
            pass


def _merge(jobs: Sequence[_Job]) -> list[tuple[Any, list[tuple]]]:
    # Rows of the same statement from every job go together: one multi-row statement per table on
    # PostgreSQL (one executemany on SQLite). Reordering across statements is safe: blob inserts are
    # idempotent per (channel, version), and every other statement keys its rows by checkpoint, so the
    # committed result is the same.
    merged: dict[Any, list[tuple]] = {}
    for job in jobs:
        for sql, rows in job.ops:
            merged.setdefault(sql, []).extend(rows)
    return [(sql, rows) for sql, rows in merged.items() if rows]


def _apply(c: Any, jobs: Sequence[_Job], pipelined: bool = False, prepare: Prepare | None = None) -> None:
    todo = _merge(jobs)
    if prepare is not None:
        prepare(c, todo)
    pg = c.dialect == "postgres"
    if pg and len(todo) > 1 and not pipelined:
        # One round trip for all statements instead of one each; errors still surface before COMMIT.
        with c.raw.pipeline():
            for sql, rows in todo:
                _one(c, sql, rows, pg)
        return
    for sql, rows in todo:
        _one(c, sql, rows, pg)


def _one(c: Any, sql: Any, rows: list[tuple], pg: bool) -> None:
    if isinstance(sql, BatchInsert):
        if pg:
            c.raw.execute(sql.pg_batch, sql.columns(rows))
        else:
            c.raw.executemany(sql.sqlite, sql.dedupe(rows))
    else:
        c.many(sql, rows)


#: Commits over which GroupCommit counts the writer threads about (see ``_second_min``).
_WINDOW = 64
#: Seconds a committer thread waits, parked, for another slot before it exits.
_COMMITTER_IDLE_S = 5.0


class _Committer:
    """A thread that commits queued batches back to back while it holds a commit slot, then parks.

    A finishing leader whose queue is not empty hands its slot to a committer instead of to the oldest
    waiter: the waiter would have to be woken and win the GIL back from the writers it just acknowledged
    before its batch could start (measured here ~0.1 ms between two SQLite commits, 15% of the commit
    slot's time with 8 writers), while a committer starts the next batch as soon as its call returns, on a
    connection that stays warm. A lone writer never meets one: it commits on its own thread.
    """

    def __init__(self, gc: GroupCommit) -> None:
        self._gc = gc
        self._signal = _held_signal()
        self._thread: threading.Thread | None = None

    def resume(self) -> bool:
        """Give this committer the slot it was chosen for (start its thread, or wake it from parking).

        False if no thread could be started (the process is out of threads): the caller must then
        ``drain`` the queue itself, so the slot, and the writers queued for it, are never stranded."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moorage-group-commit", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:
                return False
        else:
            self._signal.release()
        return True

    def drain(self) -> None:
        """Commit the queue on the calling thread until it is empty, then give the slot back."""
        self._run(park=False)

    def _run(self, park: bool = True) -> None:
        gc = self._gc
        while True:
            batch = gc._committer_batch(self, park)
            if batch is not None:
                sleepers = gc._commit(batch)
                if sleepers is not None:
                    sleepers.wake.release()
                continue
            if not park:
                return
            if not self._signal.acquire(timeout=_COMMITTER_IDLE_S):
                if gc._retire(self):
                    return
                self._signal.acquire()  # chosen just as the wait timed out: its wake-up is on the way


class GroupCommit:
    """Leader/follower batching: whoever finds a free commit slot leads and commits everything queued.

    While a transaction commits, later writers queue; the next batch takes them all (up to
    ``max_batch``) in one transaction. A leader whose own write committed hands its slot to a committer
    thread (``_Committer``) and returns, so no caller waits for other callers' batches; the committer
    commits batch after batch while writers queue, then parks. Each waiter sleeps on its own thread's
    signal, so a commit wakes exactly the writers it acknowledged: the committing thread wakes the first
    of them, and each woken writer wakes the next. A lone writer commits on its own thread and pays only
    uncontended locks. If a batch fails, each job is retried in its own transaction so one bad write
    never fails its neighbours. Coroutines queue with ``awrite``: their jobs carry a future instead of a
    sleeping thread, are committed by committer threads in the same batches, and each batch wakes each
    event loop once.
    """

    def __init__(self, ts: TenantStore, max_batch: int = 64, max_inflight: int | None = None,
                 extra_min: int = 4, prepare: Prepare | None = None, single: Single | None = None) -> None:
        self._ts = ts
        self._prepare = prepare
        self._single = single
        self._max = max(1, max_batch)
        # SQLite serialises writers on the file lock: one batch in flight. On PostgreSQL a commit is
        # mostly server work and fsync, during which the client and the other CPU idle, so a second
        # transaction may run alongside, but only for a full batch: ``extra_min`` writers queued. A
        # second transaction for whoever arrives first just splits the queue into small batches (8
        # writers averaged 2.4 puts per transaction instead of 4) and each transaction costs CPU.
        # With fewer writers than that, waiting for ``extra_min`` would serialise them (2 writers: one
        # transaction at a time, where a saver with a connection per writer commits both at once), so
        # the bar is also capped by how many writers are about: the threads that wrote during the last
        # ``_WINDOW`` commits, less the writers committing now.
        default = 2 if ts.dialect == "postgres" else 1
        self._max_inflight = max(1, max_inflight if max_inflight is not None else default)
        self._extra_min = max(1, extra_min)
        self._mu = threading.Lock()
        self._queue: list[_Job] = []
        self._inflight = 0
        #: Jobs in batches being committed now; commits done; each writer thread's last write (in commits
        #: done); how many threads wrote within the last ``_WINDOW`` commits (recounted every 16).
        self._committing = 0
        self._done = 0
        self._seen: dict[Hashable, int] = {}
        self._writers = 0
        #: Committer threads waiting for a slot (newest last).
        self._parked: list[_Committer] = []

    def write(self, ops: Ops) -> None:
        if self._ts.ambient() is not None:
            # The caller grouped work with ``ts.transaction()``: join it, commit with it.
            with self._ts._tx() as c:
                _apply(c, [_Job(ops)], prepare=self._prepare)
            return
        job = _Job(ops)
        with self._mu:
            batch = self._take(job) if self._enqueue(job, threading.get_ident()) else None
        if batch is None:
            job.wake.acquire()  # released once, when the job has committed (a waiter is never handed a slot)
            job.woken()
            return self._outcome(job)
        self._lead(job, batch)
        return self._outcome(job)

    async def awrite(self, ops: Ops) -> None:
        """``write`` for a coroutine: the job is queued from the event loop's thread and committed by a
        committer thread; the coroutine waits on a future, so no thread is held per waiting writer and
        each batch wakes the loop once. Concurrent tasks form batches as threads do (each task counts as
        a writer). Cancelling the waiting task does not withdraw a write already queued."""
        if self._ts.ambient() is not None:
            # Inside ``ts.transaction()`` on this thread: join it, as ``write`` does.
            return self.write(ops)
        job = _Job(ops, asyncio.get_running_loop().create_future())
        with self._mu:
            nxt: _Committer | None = None
            if self._enqueue(job, ("task", id(asyncio.current_task()))):
                # The slot goes straight to a committer: this thread must not block.
                nxt = self._parked.pop() if self._parked else _Committer(self)
        if nxt is not None and not nxt.resume():
            nxt.drain()  # no thread could be started: commit here (this loop waits until the queue is empty)
        await job.future

    def _enqueue(self, job: _Job, writer: Hashable) -> bool:
        """Queue ``job`` of ``writer`` (a thread or a task); whether the caller now holds a new commit slot for
        the queue: none is in flight, or a second transaction is worth it (caller holds ``_mu``)."""
        self._queue.append(job)
        self._seen[writer] = self._done
        if self._inflight == 0 or (self._inflight < self._max_inflight and len(self._queue) >= self._second_min()):
            self._inflight += 1
            return True
        return False

    def _take(self, leader: _Job | None) -> list[_Job]:
        """Pop the next batch for ``leader``'s thread, or for a committer (caller holds ``_mu``)."""
        batch = self._queue[: self._max]
        del self._queue[: self._max]
        self._committing += len(batch)
        if leader is not None:
            leader.leading = True
        return batch

    def _serves_queue(self) -> bool:
        """Whether a slot that just finished a commit goes on to the queue (caller holds ``_mu``): the last
        slot in flight always does; a second one only for a full batch (see __init__)."""
        return bool(self._queue) and (self._inflight == 1 or len(self._queue) >= self._second_min())

    def _second_min(self) -> int:
        """Writers queued that justify a transaction alongside one in flight (caller holds ``_mu``)."""
        return min(self._extra_min, max(1, self._writers - self._committing))

    def _committer_batch(self, committer: _Committer, park: bool) -> list[_Job] | None:
        """The next batch for ``committer``, which holds a slot; or None once it gave the slot back (and,
        if ``park``, joined the parked committers)."""
        with self._mu:
            if self._serves_queue():
                return self._take(None)
            self._inflight -= 1
            if park:
                self._parked.append(committer)
            return None

    def _retire(self, committer: _Committer) -> bool:
        """Whether an idle parked ``committer`` may exit: not if it was chosen for a slot meanwhile."""
        with self._mu:
            if committer in self._parked:
                self._parked.remove(committer)
                return True
            return False

    def _pass_slot(self) -> _Committer | None:
        """Give up a commit slot (caller holds ``_mu``): to a committer, which the caller must then
        ``resume``, or back to the free pool when nobody waits (or too few for a second transaction while
        another is in flight: that one's committing thread takes them when it finishes)."""
        if self._serves_queue():
            return self._parked.pop() if self._parked else _Committer(self)
        self._inflight -= 1
        return None

    def _lead(self, job: _Job, batch: list[_Job]) -> None:
        """Commit batches until ``job`` is done, then hand the commit slot on (or free it)."""
        wait = False
        while True:
            sleepers = self._commit(batch)
            nxt: _Committer | None = None
            with self._mu:
                if not job.done and job in self._queue:
                    batch = self._take(job)  # our job is still queued (behind a full batch): keep leading
                    if sleepers is not None:
                        sleepers.wake.release()
                    continue
                if not job.done:
                    # Another leader took our job into its batch: give the slot up and wait for that commit.
                    job.leading = False
                    wait = True
                nxt = self._pass_slot()
            # The committer first (the next commit starts sooner), then the first acknowledged writer,
            # whose thread wakes the next one, and so on: the leader pays one wake-up, not one per writer.
            stranded = nxt if nxt is not None and not nxt.resume() else None
            if sleepers is not None:
                sleepers.wake.release()
            if stranded is not None:
                stranded.drain()
            break
        if wait:
            job.wake.acquire()
            job.woken()

    @staticmethod
    def _outcome(job: _Job) -> None:
        if job.error is not None:
            raise job.error

    def _run(self, jobs: Sequence[_Job]) -> None:
        """Apply ``jobs`` in one transaction of their own and commit it.

        Where the batch can be one statement (``single``: the saver's statements, nothing for ``prepare``
        to do), it is: ``Backend.tenant_call`` runs it as its own transaction (PostgreSQL: one round trip,
        one execution; SQLite: lock, rows and commit in one call). Anything else runs as a transaction:
        on PostgreSQL pipelined (BEGIN, the tenant setting, every statement and COMMIT reach the server in
        one round trip; writes read nothing back, so nothing waits in between; a failure surfaces at the
        commit and rolls the whole transaction back).
        """
        if self._single is not None:
            one = self._single(_merge(jobs))
            if one is not None:
                self._ts.backend.tenant_call(self._ts.tenant_id, *one)
                return
        if self._ts.dialect == "postgres":
            with self._ts.backend.tenant_tx(self._ts.tenant_id, pipeline=True) as c:  # type: ignore[call-arg]
                _apply(c, jobs, pipelined=True)
        else:
            with self._ts._tx() as c:
                _apply(c, jobs, prepare=self._prepare)

    def _commit(self, batch: list[_Job]) -> _Job | None:
        """Commit ``batch``; hands its async jobs to their event loops and returns the first of its sleeping
        writer threads (the others chained behind it), for the caller to wake."""
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
        with self._mu:
            self._committing -= len(batch)
            self._done += 1
            if self._done % 16 == 0:
                cut = self._done - _WINDOW
                self._seen = {t: d for t, d in self._seen.items() if d >= cut}
                self._writers = len(self._seen)
            for job in batch:
                job.done = True
            sleepers = [job for job in batch if not job.leading and job.future is None]
            for a, b in zip(sleepers, sleepers[1:]):
                a.chain = b
        waiting = [job for job in batch if job.future is not None]
        if waiting:
            _notify(waiting)
        return sleepers[0] if sleepers else None
