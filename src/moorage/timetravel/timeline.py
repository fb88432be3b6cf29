"""Time travel for a whole agent instance: checkpoints of its sandbox and its store state taken together,
rollback of both to one of them (what came after kept as an abandoned branch), and forks into new end-users.

The sandbox half is the driver's own checkpoint (``Sandbox.checkpoint/rollback``); the store half is
``store.repos.checkpoints``. Every operation holds the instance the way a turn does (its line in the router
and the instance manager's turn), so no turn of the instance runs in between; the automatic one runs after the
turn's reply went out, while the turn still holds the instance. Forks into new users are ``fork.py``; the policy,
retention and how a checkpoint is shown, ``retention.py``. See docs/timetravel.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound, TenantScopeError
from moorage.log import get_logger
from moorage.store import EntityKey, Principal, Scope, TenantStore
from moorage.store.model import check_id
from moorage.store.repos.checkpoints import MISSING, Checkpoint, checkpoints_of, new_checkpoint_id
from moorage.timetravel.fork import check_new_users, fork_through
from moorage.timetravel.retention import Policy, checkpoint_view, lineage, restorable, to_keep

if TYPE_CHECKING:
    from moorage.runtime.host_calls import TurnBinding
    from moorage.sandbox import Sandbox

log = get_logger(__name__)

#: Sandbox drivers on which automatic checkpoints are on unless an agent says otherwise: those whose automatic
#: checkpoint, taken after the reply, adds at most 5 ms p50 to an awake turn on a quiet host (``bench/timetravel``;
#: the micro-VM driver since its disk runs with lazy refcounts: docs/timetravel.md has the loaded-host figures).
AUTO_DRIVERS = frozenset({"process", "microvm"})
#: At close, how long automatic checkpoints still being taken may run before they are cancelled: one takes
#: milliseconds to seconds. A cancel stops the turn's task but not a copy or store write already handed to a worker
#: thread (that finishes on its own), so the wait is generous and cancelling is for a checkpoint that hangs.
CLOSE_WAIT_S = 60.0


class CheckpointGone(ConflictError):
    """The sandbox half of a checkpoint does not exist (the instance was provisioned again since, or it was never
    written: the host stopped while it was written behind its turn)."""

    code = "checkpoint-gone"


def _keeps_nothing(ts: TenantStore, agent: str, rec: Any = None) -> bool:
    from moorage.store import zero_retention

    return zero_retention.is_zero(rec if rec is not None else ts.agents.get(agent))


async def _settled(op: Callable[[], Awaitable[None]], tries: int = 4, pause_s: float = 0.5) -> None:
    """A sandbox rollback after a host crash, tried again a few times: the micro-VM the dead host started is
    killed by the rollback, and its disk lock can outlive the moment its pid looks gone (a multi-threaded QEMU's
    leader exits before its other threads close the image)."""
    from moorage.sandbox import SandboxError

    for attempt in range(tries):
        try:
            await op()
            return
        except SandboxError as e:
            if attempt == tries - 1:
                raise
            log.warning("sandbox rollback after a crash failed; trying again", error=str(e)[:300])
            await asyncio.sleep(pause_s * (attempt + 1))


def _scope_of(manifest: dict[str, Any]) -> str:
    return str((manifest.get("lifecycle") or {}).get("scope", manifest.get("scope", "user")))


def _can_delete(sandbox: Any) -> bool:
    from moorage.sandbox import Sandbox

    return type(sandbox).delete_checkpoint is not Sandbox.delete_checkpoint


def _known_user(ts: TenantStore, agent: str, user: str) -> bool:
    """Whether ``user`` is one of ``agent``'s end-users (registered, or from before users were per agent: a session
    of theirs exists, as ``Router.resolve`` counts them). Raises NotFound for an agent that does not exist."""
    ts.agents.get(agent)
    return ts.agent_users.find(agent, user) is not None or bool(ts.sessions.list(agent, user, limit=1))


class TimeTravel:
    """Checkpoints, rollback and fork of agent instances, on one runtime."""

    #: Retention runs when an instance's checkpoint sequence number is a multiple of this.
    PRUNE_EVERY = 10

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        #: (tenant, agent, user) -> set once the automatic checkpoint after a turn whose reply went out is taken.
        self._inflight: dict[tuple[str, str, str], asyncio.Event] = {}
        #: Turns whose reply went out and whose automatic checkpoint runs on (asyncio keeps only weak references).
        self._tails: set[asyncio.Task[Any]] = set()
        #: (tenant, agent, user) -> the task deleting the sandbox halves of checkpoints its last retention pruned.
        self._retention: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        instances = getattr(runtime, "instances", None)
        if instances is not None and hasattr(instances, "on_takeover"):
            instances.on_takeover = self.taken_over

    # -- the automatic checkpoint at the end of a turn ------------------------------------------------------

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
            if ck.seq % self.PRUNE_EVERY == 0:
                try:
                    names = await self._prune(b.ts, b.entity.agent, b.entity.user, sandbox, Policy.of(b.manifest))
                except Exception as e:  # noqa: BLE001 - retention runs again at the next tenth checkpoint
                    log.warning("checkpoint retention failed", agent=b.entity.agent, user=b.entity.user, error=str(e))
                    names = []
                if names:
                    # The pruned checkpoints' sandbox halves are removed after the instance is let go: nothing can
                    # restore them any more (their rows are gone), and the next turn need not wait for the disk.
                    # ``settled`` (a listing, a sleep, a forget) still waits for them.
                    task = asyncio.get_running_loop().create_task(self._delete_sandbox_checkpoints(
                        sandbox, names, self._retention.get(key)), name="checkpoint-retention")
                    self._retention[key] = task
                    task.add_done_callback(lambda t: self._retention.pop(key, None) if self._retention.get(key) is t else None)
                    self.keep_tail(task)
            log.debug("checkpoint after turn", agent=b.entity.agent, user=b.entity.user, checkpoint=ck.id,
                      ms=round((time.perf_counter() - started) * 1000, 1))
            return ck
        finally:
            done.set()
            if self._inflight.get(key) is done:
                del self._inflight[key]

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
            tasks = mine(self._retention)
            if tasks:
                await asyncio.wait(tasks)

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(both(), timeout_s)

    async def _take(self, ts: TenantStore, agent: str, user: str, sandbox: "Sandbox | None", *, kind: str,
                    name: str | None = None, turn_id: str | None = None,
                    summary: dict[str, Any] | None = None, durable: bool = True) -> Checkpoint:
        # The sandbox half first: a store row never names a sandbox checkpoint that was not taken (a crash in
        # between leaves an unnamed sandbox checkpoint, which costs disk and nothing else). ``durable=False`` (the
        # automatic one after a turn): the sandbox's files are written behind, while the next turn may already run;
        # a host that dies meanwhile leaves a row whose sandbox half is missing, which rollback and fork refuse
        # (``_sandbox_half``) before they change anything.
        cid = new_checkpoint_id()
        vm = None
        if sandbox is not None:
            t0 = time.perf_counter()
            vm = (await sandbox.checkpoint(f"tt-{cid}", durable=durable)).name
            summary = {**(summary or {}), "sandbox_ms": round((time.perf_counter() - t0) * 1000, 1)}
        return await asyncio.to_thread(checkpoints_of(ts).take, agent, user, kind=kind, name=name, turn_id=turn_id,
                                       sandbox_id=sandbox.id if sandbox is not None else None,
                                       sandbox_checkpoint=vm, checkpoint_id=cid, summary=summary)

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

    # -- holding an instance --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _hold(self, ts: TenantStore, agent: str, user: str) -> AsyncIterator["Sandbox"]:
        """The instance's running sandbox, held like a turn: in its line in the router (turns of a ``queue`` or
        ``reject`` agent wait) and in the instance manager (never slept or evicted meanwhile)."""
        rt = self.rt
        if not await asyncio.to_thread(_known_user, ts, agent, user):
            # Not made here even for an agent whose users are made on their first turn: a typo'd id would otherwise
            # get a user, an instance and a checkpoint of its own.
            raise NotFound(f"agent {agent!r} has no user {user!r}",
                           hint=f"time travel works on users the agent already has (GET /v1/agents/{agent}/users lists them)")
        agent_rec, lc, scope = await asyncio.to_thread(rt.router.resolve, ts, EntityKey(agent, user, "default"))
        if lc.scope != "user":
            raise InvalidInput(f"agent {agent!r} has one instance per {lc.scope}; time travel works on per-user instances",
                               hint='set [agent] scope = "user"')
        if _keeps_nothing(ts, agent, agent_rec):
            raise InvalidInput(f"agent {agent!r} keeps nothing of its turns (zero retention); a checkpoint would "
                               "keep them", hint="turn zero retention off to checkpoint, roll back or fork its users")

        async def template() -> Any:
            return await rt._template_for(ts, agent_rec)

        async with rt.router._on_instance((ts.tenant_id, scope.key), "-time-travel", scope, lc):
            async with rt.instances.turn(ts, scope, template, lifecycle=lc) as sandbox:
                await self._finish_pending(ts, agent, user, sandbox)
                yield sandbox

    async def taken_over(self, ts: TenantStore, scope: Scope, sandbox: "Sandbox") -> None:
        """In a fleet, an instance whose host died woke on this one, before any turn of it: finish a rollback or
        fork its old host left half done (``timetravel/takeover.py``)."""
        from moorage.timetravel.takeover import finish_after_takeover

        await finish_after_takeover(self, ts, scope, sandbox)

    async def _finish_pending(self, ts: TenantStore, agent: str, user: str, sandbox: "Sandbox") -> None:
        """Finish an operation a killed host left half done, so the instance is entirely at one point."""
        repo = checkpoints_of(ts)
        head = await asyncio.to_thread(repo.head, agent, user)
        pending = head.pending if head else None
        if not pending:
            return
        log.warning("finishing an interrupted time-travel operation", agent=agent, user=user, op=pending.get("op"))
        if pending.get("op") == "rollback":
            target = await asyncio.to_thread(repo.get, agent, user, pending["to"])
            await _settled(lambda: self._vm_rollback(sandbox, target))
            await asyncio.to_thread(repo.rollback, agent, user, target.id)
        elif pending.get("op") == "fork-restore":
            await _settled(lambda: sandbox.rollback(pending["vm"]))
            self.rt._loaded.pop(sandbox.id, None)
            await asyncio.to_thread(repo.set_pending, agent, user, None)
        self._forget_cached(ts)

    def _forget_cached(self, ts: TenantStore) -> None:
        # The runtime's per-tenant memory tiers may hold vectors of rows that are gone now.
        self.rt._memories.pop(ts.tenant_id, None)

    @staticmethod
    async def _sandbox_half(sandbox: "Sandbox", target: Checkpoint) -> None:
        """Refuse a checkpoint whose sandbox half is not there (taken of another sandbox, or never written: the
        host died, or the disk failed, while it was written behind its turn) before anything changes."""
        if not target.sandbox_checkpoint:
            return
        if target.sandbox_id != sandbox.id:
            raise CheckpointGone(f"the sandbox of checkpoint {target.id} is gone (the instance was provisioned "
                                 "again since)", hint="use a checkpoint taken since")
        if target.sandbox_checkpoint not in {c.name for c in await sandbox.checkpoints()}:
            raise CheckpointGone(f"the sandbox half of checkpoint {target.id} is not in the instance's copy (it was "
                                 "never written: the host stopped or its disk failed while it was written; in a "
                                 "fleet, its host stopped before shipping it)", hint="use another checkpoint")

    async def _vm_rollback(self, sandbox: "Sandbox", target: Checkpoint) -> None:
        if not target.sandbox_checkpoint:
            return
        if target.sandbox_id != sandbox.id:
            raise CheckpointGone(f"checkpoint {target.id} was taken of sandbox {target.sandbox_id}; the instance now "
                                 f"runs in {sandbox.id}", hint="roll back to a checkpoint taken since")
        await sandbox.rollback(target.sandbox_checkpoint)
        self.rt._loaded.pop(sandbox.id, None)  # a process sandbox restarted: the agent's code is loaded again

    # -- the verbs ------------------------------------------------------------------------------------------

    def _ts(self, principal: Principal, agent: str, user: str, *scopes: str) -> TenantStore:
        """The caller's tenant store, once it may act on this agent and user with one of ``scopes``. The verbs'
        ``as_scope`` is the scope of the route that calls them: ``provision`` for the checkpoint routes, ``deploy``
        for the sandbox verbs (``Runtime.sandbox``)."""
        if not principal.allows(*scopes):
            raise TenantScopeError(f"this key lacks the {' or '.join(repr(s) for s in scopes)} scope",
                                   hint=f"use a key with the {scopes[0]} scope")
        check_id(agent, "agent id"), check_id(user, "user id")
        if principal.agent is not None and principal.agent != agent:
            raise TenantScopeError(f"this key may only act on agent {principal.agent!r}")
        if principal.user is not None and principal.user != user:
            raise TenantScopeError(f"this key may only act for user {principal.user!r}")
        return self.rt.store.tenant(principal)

    async def list(self, principal: Principal, agent: str, user: str, *, limit: int = 100) -> dict[str, Any]:
        """The instance's checkpoints (newest first) with what each turn did, and its branches."""
        ts = self._ts(principal, agent, user, "read", "provision")
        repo = checkpoints_of(ts)
        await asyncio.to_thread(ts.agents.get, agent)
        await self.settled(ts.tenant_id, agent, user)
        cks = await asyncio.to_thread(repo.list, agent, user, limit=100_000)
        head = await asyncio.to_thread(repo.head, agent, user)
        current = head.branch if head else None
        branches: dict[str, dict[str, Any]] = {}
        for c in sorted(cks, key=lambda c: c.seq):
            if c.kind == MISSING:
                continue  # a failed automatic checkpoint: listed, but no point of any branch
            br = branches.setdefault(c.branch, {"id": c.branch, "from": c.parent_id, "current": c.branch == current,
                                                "checkpoints": 0, "tip": None})
            br["checkpoints"] += 1
            br["tip"] = c.id
        if head is not None and head.branch not in branches:
            branches[head.branch] = {"id": head.branch, "from": head.head_id, "current": True, "checkpoints": 0,
                                     "tip": None}
        history = {c.id for c in lineage(cks, head.head_id if head else None)}
        storage = await asyncio.to_thread(repo.storage_bytes, agent, user)
        sandbox_id, halves = await self._sandbox_halves(ts, agent, user)
        return {"object": "list", "agent": agent, "user": user, "head": head.head_id if head else None,
                "branch": current, "store_bytes": storage,
                "sandbox_bytes": None if halves is None else sum(b for n, b in halves.items() if n.startswith("tt-")),
                "data": [checkpoint_view(c, current_branch=current, restorable=restorable(c, sandbox_id, halves),
                                         in_history=c.id in history or (c.kind == MISSING and c.branch == current))
                         for c in cks[:limit]],
                "branches": list(branches.values())}

    async def _sandbox_halves(self, ts: TenantStore, agent: str, user: str) -> tuple[str | None, dict[str, int] | None]:
        """The instance's sandbox and the checkpoints it holds on this host, name to bytes (None: its sandbox is
        not here)."""
        rec = await asyncio.to_thread(ts.sandboxes.for_scope, Scope.for_user(agent, user))
        if rec is None:
            return None, None
        fleet = getattr(self.rt.instances, "fleet", None)
        if fleet is not None and rec.host not in (None, fleet.host_id):
            from moorage.lifecycle import fleet as fleet_rules

            if await asyncio.to_thread(fleet_rules.disk_holder, fleet, rec) is not None:
                return rec.id, None  # its newest copy is on that live host's disk (a copy here may be an older one)
            # Its host is gone: any host that wakes it resumes from its last shipped snapshot, which says.
            return rec.id, await asyncio.to_thread(fleet.shipped_checkpoints, rec)
        try:
            sandbox = await self.rt.driver.open(rec.id)
            return rec.id, {c.name: c.bytes for c in await sandbox.checkpoints()}
        except Exception:  # noqa: BLE001 - on another host, or gone: not known here
            return rec.id, None

    async def find(self, principal: Principal, agent: str, user: str, ref: str, *,
                   as_scope: str = "provision") -> Checkpoint:
        """The instance's checkpoint whose id is ``ref``, else its newest one named ``ref``."""
        ts = self._ts(principal, agent, user, as_scope, "read")
        return await asyncio.to_thread(checkpoints_of(ts).by_ref, agent, user, ref)

    async def take(self, principal: Principal, agent: str, user: str, name: str | None = None, *,
                   as_scope: str = "provision") -> Checkpoint:
        ts = self._ts(principal, agent, user, as_scope)
        async with self._hold(ts, agent, user) as sandbox:
            return await self._take(ts, agent, user, sandbox, kind="manual", name=name)

    async def take_in_turn(self, b: "TurnBinding", sandbox: "Sandbox", name: str) -> Checkpoint:
        """``ctx.checkpoint(name)`` from the agent's code, at that point of the turn (which already holds the
        instance): the sandbox as it is now, and the store as the turn's writes so far left it (each host call
        commits when it happens). The turn itself is recorded as running in it (``summary.during_turn``); a
        rollback or fork to it ends that run as failed. A turn replayed after a crash that asks again for the same
        name gets the checkpoint it already took."""
        ts, agent, user = b.ts, b.entity.agent, b.entity.user
        if _scope_of(b.manifest) != "user":
            raise InvalidInput(f"agent {agent!r} has one instance per {_scope_of(b.manifest)}; checkpoints are "
                               "taken of per-user instances", hint='set [agent] scope = "user"')
        if await asyncio.to_thread(_keeps_nothing, ts, agent):
            raise InvalidInput(f"agent {agent!r} keeps nothing of its turns (zero retention); a checkpoint would "
                               "keep them", hint="turn zero retention off to checkpoint its users")
        for ck in await asyncio.to_thread(checkpoints_of(ts).list, agent, user, limit=200):
            if ck.name == name and ck.summary.get("during_turn") == b.turn_id:
                return ck
        return await self._take(ts, agent, user, sandbox, kind="manual", name=name, turn_id=None,
                                summary={"during_turn": b.turn_id})

    async def rollback(self, principal: Principal, agent: str, user: str, checkpoint_id: str, *,
                       as_scope: str = "provision") -> dict[str, Any]:
        """Put the instance's sandbox and store state back to the checkpoint. The state it leaves is checkpointed
        first (``before-rollback``): the abandoned branch's tip, listable and restorable by another rollback."""
        ts = self._ts(principal, agent, user, as_scope)
        repo = checkpoints_of(ts)
        target = await asyncio.to_thread(repo.restorable, agent, user, checkpoint_id)
        started = time.perf_counter()
        async with self._hold(ts, agent, user) as sandbox:
            await self._sandbox_half(sandbox, target)
            left = await self._take(ts, agent, user, sandbox, kind="before-rollback",
                                    summary={"rolled_back_to": target.id})
            # The intent first: a host killed between the sandbox's rollback and the store's finishes both later.
            await asyncio.to_thread(repo.set_pending, agent, user, {"op": "rollback", "to": target.id})
            await self._vm_rollback(sandbox, target)
            branch = await asyncio.to_thread(repo.rollback, agent, user, target.id)
            self._forget_cached(ts)
        ms = round((time.perf_counter() - started) * 1000, 1)
        log.info("instance rolled back", agent=agent, user=user, to=target.id, ms=ms)
        return {"object": "rollback", "agent": agent, "user": user, "rolled_back_to": target.id, "branch": branch,
                "abandoned": {"branch": left.branch, "tip": left.id}, "ms": ms}

    async def fork_now(self, principal: Principal, agent: str, user: str, to_users: Sequence[str],
                       name: str | None = None, *, as_scope: str = "provision") -> dict[str, Any]:
        """``fork`` of the instance as it is now: a manual checkpoint (``name``, if given), then a fork at it. New
        users that cannot be made are refused before the checkpoint is taken."""
        ts = self._ts(principal, agent, user, as_scope)
        await check_new_users(ts, agent, user, to_users)
        self.rt.instances.refuse_if_draining("forks")
        ck = await self.take(principal, agent, user, name, as_scope=as_scope)
        return await self._fork(ts, agent, user, ck.id, to_users)

    async def fork(self, principal: Principal, agent: str, user: str, checkpoint_id: str,
                   to_users: Sequence[str], *, as_scope: str = "provision") -> dict[str, Any]:
        """New end-users of the same agent, each starting from the checkpoint: its sandbox (a copy-on-write fork
        of a template made from it) and its store state (copied, new ids). The source instance is unchanged."""
        ts = self._ts(principal, agent, user, as_scope)
        # A draining host starts none (nothing is written yet: the retry lands on a live host); one begun here
        # before the drain finishes here, its users held like turns until their first checkpoint is taken.
        self.rt.instances.refuse_if_draining("forks")
        return await self._fork(ts, agent, user, checkpoint_id, to_users)

    async def _fork(self, ts: TenantStore, agent: str, user: str, checkpoint_id: str,
                    to_users: Sequence[str]) -> dict[str, Any]:
        await check_new_users(ts, agent, user, to_users)
        target = await asyncio.to_thread(checkpoints_of(ts).restorable, agent, user, checkpoint_id)
        started = time.perf_counter()
        with self.rt.templates.fork_template() as template_id:  # the collection leaves it alone while this runs
            return await fork_through(self, ts, agent, user, target, to_users, template_id, started)

    async def recover(self) -> int:
        """At host start, before turns resume: finish every operation a killed host left half done."""
        done = 0
        for ts in await asyncio.to_thread(lambda: list(self.rt.store.operator.tenants())):
            for agent, user in await asyncio.to_thread(checkpoints_of(ts).pending):
                try:
                    async with self._hold(ts, agent, user):
                        done += 1  # _hold finished it
                except Exception as e:  # noqa: BLE001 - one broken instance must not stop the host
                    log.warning("could not finish an interrupted time-travel operation", agent=agent, user=user,
                                error=str(e))
        return done

    async def forget(self, ts: TenantStore, agent: str, user: str) -> int:
        return await asyncio.to_thread(checkpoints_of(ts).delete_user, agent, user)
