"""Taking checkpoints: the automatic one at the end of a turn (after its reply went out) and its retention, waiting
for them before a listing, a sleep or a forget, and letting them end when the host closes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, Protocol

from moorage.aio import within
from moorage.log import get_logger
from moorage.observability import events
from moorage.store import EntityKey, Scope, TenantStore
from moorage.store.repos.checkpoints import Checkpoint, check_name, checkpoints_of, new_checkpoint_id
from moorage.timetravel.holding import _keeps_nothing
from moorage.timetravel.retention import Policy, to_keep

if TYPE_CHECKING:
    from moorage.sandbox import Sandbox

log = get_logger("moorage.timetravel.timeline")


class TurnBinding(Protocol):
    """What time travel reads of the turn it checkpoints: the runtime's ``TurnBinding`` is one (this package does
    not import the runtime, which imports it)."""

    turn_id: str
    ts: TenantStore
    entity: EntityKey
    manifest: dict[str, Any]

#: Sandbox drivers on which automatic checkpoints are on unless an agent says otherwise: those whose automatic
#: checkpoint, taken after the reply, adds at most 5 ms p50 to an awake turn on a quiet host (``bench/timetravel``;
#: the micro-VM driver since its disk runs with lazy refcounts: docs/timetravel.md has the loaded-host figures).
AUTO_DRIVERS = frozenset({"process", "microvm"})
#: At close, how long automatic checkpoints still being taken may run before they are cancelled: one takes
#: milliseconds to seconds. A cancel stops the turn's task but not a copy or store write already handed to a worker
#: thread (that finishes on its own), so the wait is generous and cancelling is for a checkpoint that hangs.
CLOSE_WAIT_S = 60.0


def _scope_of(manifest: dict[str, Any]) -> str:
    return str((manifest.get("lifecycle") or {}).get("scope", manifest.get("scope", "user")))


def _can_delete(sandbox: Any) -> bool:
    from moorage.sandbox import Sandbox

    return type(sandbox).delete_checkpoint is not Sandbox.delete_checkpoint


def _live_manifest(ts: TenantStore, agent: str) -> dict[str, Any]:
    rec = ts.agents.get(agent)
    return ts.deployments.get(rec.live_deployment).manifest if rec.live_deployment else {}


class AutoCheckpoints:
    """How ``TimeTravel`` takes checkpoints (a mixin: the timeline holds the state named below)."""

    rt: Any
    PRUNE_EVERY: int
    _inflight: dict[tuple[str, str, str], asyncio.Event]
    _tails: set[asyncio.Task[Any]]
    _retention: dict[tuple[str, str, str], asyncio.Task[None]]
    _written: dict[tuple[str, str, str], asyncio.Task[None]]

    def will_checkpoint(self, b: "TurnBinding") -> bool:
        """Whether this turn ends with an automatic checkpoint (its agent's policy, else the driver's default;
        per-user instances only)."""
        auto = Policy.of(b.manifest).auto
        if auto is None:
            auto = getattr(self.rt.driver, "name", None) in AUTO_DRIVERS
        return auto and _scope_of(b.manifest) == "user"

    async def after_turn(self, sandbox: "Sandbox", b: "TurnBinding") -> Checkpoint | None:
        """The automatic checkpoint, called by the runtime after the turn's reply went out while the turn still
        holds its instance (no next turn of it starts before this ends). Never fails the turn: a failure is
        logged and recorded as a ``missing`` checkpoint in the turn's place in the list."""
        if not self.will_checkpoint(b):
            return None
        key = (b.ts.tenant_id, b.entity.agent, b.entity.user)
        done = self._inflight[key] = asyncio.Event()  # before the first await: ``settled`` finds it
        started = time.perf_counter()
        try:
            if await asyncio.to_thread(_keeps_nothing, b.ts, b.entity.agent):
                return None  # zero retention: a checkpoint would keep what the turn's end purges
            try:
                ck = await self._take(b.ts, b.entity.agent, b.entity.user, sandbox, kind="turn", turn_id=b.turn_id,
                                      durable=False)
            except Exception as e:  # noqa: BLE001 - a checkpoint that fails costs a restore point, never the turn
                log.warning("checkpoint after turn failed", agent=b.entity.agent, user=b.entity.user, error=str(e))
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(checkpoints_of(b.ts).record_missing, b.entity.agent, b.entity.user,
                                            turn_id=b.turn_id, error=f"{type(e).__name__}: {e}")
                return None
            await self._retain(b.ts, b.entity.agent, b.entity.user, sandbox, ck, Policy.of(b.manifest))
            log.debug("checkpoint after turn", agent=b.entity.agent, user=b.entity.user, checkpoint=ck.id,
                      ms=round((time.perf_counter() - started) * 1000, 1))
            return ck
        finally:
            done.set()
            if self._inflight.get(key) is done:
                del self._inflight[key]

    async def _retain(self, ts: TenantStore, agent: str, user: str, sandbox: "Sandbox | None", ck: Checkpoint,
                      policy: Policy | None = None) -> None:
        """Retention, when ``ck`` (just taken, of any kind: automatic, asked for, a rollback's) is a tenth checkpoint
        of the instance; called while the instance is held. Never fails its caller."""
        if ck.seq % self.PRUNE_EVERY != 0:
            return
        key = (ts.tenant_id, agent, user)
        try:
            if policy is None:  # not in a turn: the live deployment's [agent.timetravel]
                policy = Policy.of(await asyncio.to_thread(_live_manifest, ts, agent))
            names = await self._prune(ts, agent, user, sandbox, policy)
        except Exception as e:  # noqa: BLE001 - retention runs again at the next tenth checkpoint
            log.warning("checkpoint retention failed", agent=agent, user=user, error=str(e))
            return
        if names:
            # The pruned checkpoints' sandbox halves are removed after the instance is let go: nothing can
            # restore them any more (their rows are gone), and the next turn need not wait for the disk.
            # ``settled`` (a listing, a sleep, a forget) still waits for them.
            task = asyncio.get_running_loop().create_task(self._delete_sandbox_checkpoints(
                sandbox, names, self._retention.get(key)), name="checkpoint-retention")
            self._retention[key] = task
            task.add_done_callback(lambda t: self._retention.pop(key, None) if self._retention.get(key) is t else None)
            self.keep_tail(task)

    @staticmethod
    async def _delete_sandbox_checkpoints(sandbox: "Sandbox", names: list[str],
                                          before: "asyncio.Task[None] | None") -> None:
        if before is not None:  # the previous retention's deletions of this instance first (one at a time)
            await asyncio.wait([before])
        for name in names:
            with contextlib.suppress(Exception):  # a sandbox destroyed meanwhile took them with it
                await sandbox.delete_checkpoint(name)

    def keep_tail(self, task: "asyncio.Task[Any]") -> None:
        """Hold a turn's task whose reply went out while its automatic checkpoint runs on; log how it ends."""
        self._tails.add(task)

        def ended(t: "asyncio.Task[Any]") -> None:
            self._tails.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("a turn failed after its reply went out", task=t.get_name(), error=str(t.exception()))

        task.add_done_callback(ended)

    async def close(self, timeout_s: float = CLOSE_WAIT_S) -> tuple[int, int]:
        """Let the work this timeline runs in the background end before the driver, the instance manager and the
        store it uses are closed: turns whose reply went out and whose automatic checkpoint runs on, and the
        deletions retention started. Waits up to ``timeout_s`` for them to finish, then cancels what is left and
        waits for it to unwind. Returns (finished, cancelled); callable again (a later tail is waited for too)."""
        finished = cancelled = 0
        deadline = time.monotonic() + timeout_s
        # A tail that ends may have started a retention task (added before it ended): loop until none is left.
        while self._tails:
            pending = set(self._tails)
            left = deadline - time.monotonic()
            if left > 0:
                done, late = await asyncio.wait(pending, timeout=left)
                finished += len(done)
                if not late:
                    continue
            else:
                late = pending
            log.warning("closing with automatic checkpoints still running: cancelling them",
                        tasks=sorted(t.get_name() for t in late), waited_s=timeout_s)
            for t in late:
                t.cancel()
            # Cancelled, each unwinds (the turn lets its instance go) before the caller closes what it used.
            await asyncio.wait(late)
            cancelled += sum(1 for t in late if t.cancelled())
            finished += sum(1 for t in late if not t.cancelled())
        return finished, cancelled

    async def settled_scope(self, tenant_id: str, scope: Scope) -> None:
        """``settled`` for the instance of ``scope`` (the instance manager's hook before a requested sleep)."""
        if scope.user is not None:
            await self.settled(tenant_id, scope.agent, scope.user)

    async def settled(self, tenant_id: str, agent: str, user: str | None, timeout_s: float = 120.0) -> None:
        """Wait for the automatic checkpoint of the user's (or, without a user, any user's) last turn if it is
        still being taken, and for the deletions its retention started: a listing, a sleep or a forget that follows
        a reply sees that turn's checkpoint and no checkpoint it pruned."""

        def mine(d: dict[tuple[str, str, str], Any]) -> list[Any]:
            return [v for (t, a, u), v in list(d.items()) if t == tenant_id and a == agent and (user is None or u == user)]

        async def both() -> None:
            await asyncio.gather(*(ev.wait() for ev in mine(self._inflight)))
            # Then the sandbox halves its retention deletes (started by the checkpoints just waited for).
            tasks = mine(self._retention) + mine(self._written)
            if tasks:
                await asyncio.wait(tasks)

        with contextlib.suppress(asyncio.TimeoutError):
            await within(both(), timeout_s)

    async def _take(self, ts: TenantStore, agent: str, user: str, sandbox: "Sandbox | None", *, kind: str,
                    name: str | None = None, turn_id: str | None = None,
                    summary: dict[str, Any] | None = None, durable: bool = True) -> Checkpoint:
        # The sandbox half first: a store row never names a sandbox checkpoint that was not taken (a crash in
        # between leaves an unnamed sandbox checkpoint, which costs disk and nothing else). ``durable=False`` (the
        # automatic one after a turn): the sandbox's files are written behind, while the next turn may already run;
        # a host that dies meanwhile leaves a row whose sandbox half is missing, which rollback and fork refuse
        # (``_sandbox_half``) before they change anything.
        check_name(name)  # before the sandbox half: a name the store refuses would leave that half on disk for good
        cid = new_checkpoint_id()
        vm = behind = None
        if sandbox is not None:
            t0 = time.perf_counter()
            with events.timed("checkpoint", kind):
                vm = (await sandbox.checkpoint(f"tt-{cid}", durable=durable)).name
            summary = {**(summary or {}), "sandbox_ms": round((time.perf_counter() - t0) * 1000, 1)}
            if not durable and hasattr(sandbox, "writing_behind"):
                behind = sandbox.writing_behind(vm)
        ck = await asyncio.to_thread(checkpoints_of(ts).take, agent, user, kind=kind, name=name, turn_id=turn_id,
                                     sandbox_id=sandbox.id if sandbox is not None else None,
                                     sandbox_checkpoint=vm, checkpoint_id=cid, summary=summary,
                                     writing=behind is not None)
        if behind is not None:  # ``settled`` (a listing, a sleep, a forget) waits for it
            key = (ts.tenant_id, agent, user)
            task = asyncio.get_running_loop().create_task(self._once_written(ts, ck, behind), name="checkpoint-written")
            self._written[key] = task
            task.add_done_callback(lambda t: self._written.pop(key, None) if self._written.get(key) is t else None)
            self.keep_tail(task)
        return ck

    async def _once_written(self, ts: TenantStore, ck: Checkpoint, behind: "asyncio.Task[str | None]") -> None:
        """Once the files of ``ck``, written behind its turn, are on disk, its mark goes; when they could not be
        written (a disk error, the disk full) it is marked ``missing`` at once, as the next start would."""
        error = await asyncio.shield(behind)
        repo = checkpoints_of(ts)
        try:
            if error is None:
                await asyncio.to_thread(repo.written, ck.agent, ck.user, ck.id)
            elif await asyncio.to_thread(repo.mark_unwritten, ck.agent, ck.user, ck.id,
                                         f"its sandbox files could not be written behind its turn ({error})"):
                log.warning("automatic checkpoint not written: marked missing", agent=ck.agent, user=ck.user,
                            checkpoint=ck.id, error=error)
        except Exception as e:  # noqa: BLE001 - the next start checks a row still marked
            log.warning("could not record whether a checkpoint was written", agent=ck.agent, user=ck.user,
                        checkpoint=ck.id, error=str(e))

    async def _prune(self, ts: TenantStore, agent: str, user: str, sandbox: "Sandbox | None", policy: Policy) -> list[str]:
        """Apply the retention policy to the store; returns the pruned checkpoints' sandbox halves to delete."""
        repo = checkpoints_of(ts)

        def prune() -> list[Any]:
            cks = repo.list(agent, user, limit=100_000)
            head = repo.head(agent, user)
            keep = to_keep(cks, head.branch if head else None, head.head_id if head else None, policy, time.time())
            return repo.prune(agent, user, keep)

        gone = await asyncio.to_thread(prune)
        if sandbox is None or not _can_delete(sandbox):
            return []
        return [ck.sandbox_checkpoint for ck in gone if ck.sandbox_checkpoint and ck.sandbox_id == sandbox.id]
