"""Time travel for a whole agent instance: checkpoints of its sandbox and its store state taken together,
rollback of both to one of them (what came after kept as an abandoned branch), and forks into new end-users.

The sandbox half is the driver's own checkpoint (``Sandbox.checkpoint/rollback``); the store half is
``store.repos.checkpoints``. Every operation holds the instance the way a turn does (its line in the router
and the instance manager's turn), so no turn of the instance runs in between; the automatic one runs after the
turn's reply went out, while the turn still holds the instance. Forks into new users are ``fork.py``; the policy,
retention and how a checkpoint is shown, ``retention.py``; taking checkpoints (the automatic one after a turn and its
retention), ``auto.py``; holding an instance like a turn and finishing what a killed host left half done,
``holding.py``. See docs/timetravel.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Sequence

from moorage.errors import InvalidInput, TenantScopeError
from moorage.log import get_logger
from moorage.store import Principal, Scope, TenantStore
from moorage.store.model import check_id
from moorage.store.repos.checkpoints import MISSING, Checkpoint, check_name, checkpoints_of
from moorage.timetravel.auto import AUTO_DRIVERS, CLOSE_WAIT_S, AutoCheckpoints, TurnBinding, _can_delete, _scope_of
from moorage.timetravel.fork import check_new_users, fork_through
from moorage.timetravel.gate import Gate
from moorage.timetravel.holding import CheckpointGone, Holding, _keeps_nothing
from moorage.timetravel.retention import Policy, checkpoint_view, lineage, restorable
from moorage.usage import tenant_cap

if TYPE_CHECKING:
    from moorage.sandbox import Sandbox

log = get_logger(__name__)

#: Sandbox drivers whose automatic checkpoints have their files written behind the turn (``checkpoint(durable=
#: False)``): the only ones a killed host can leave a row of without its files (``_unwritten``).
BEHIND_DRIVERS = frozenset({"microvm"})


def _key(ts: TenantStore, agent: str, user: str) -> tuple[str, str]:
    """The instance's key in the operator verbs' ``Gate``."""
    return ts.tenant_id, Scope.for_user(agent, user).key


def _what(agent: str, user: str) -> str:
    return f"the instance of user {user!r} of agent {agent!r}"


class TimeTravel(AutoCheckpoints, Holding):
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
        #: Per instance, the task that records whether its last automatic checkpoint's files were written.
        self._written: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        instances = getattr(runtime, "instances", None)
        if instances is not None and hasattr(instances, "on_takeover"):
            instances.on_takeover = self.taken_over

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
        check_name(name)  # before the instance is woken and held
        await tenant_cap.admit(self.rt.config, ts, 0, "a checkpoint")
        async with self._hold(ts, agent, user) as sandbox:
            ck = await self._take(ts, agent, user, sandbox, kind="manual", name=name)
            await self._retain(ts, agent, user, sandbox, ck)
            return ck

    async def take_in_turn(self, b: "TurnBinding", sandbox: "Sandbox", name: str) -> Checkpoint:
        """``ctx.checkpoint(name)`` from the agent's code, at that point of the turn (which already holds the
        instance): the sandbox as it is now, and the store as the turn's writes so far left it (each host call
        commits when it happens). The turn itself is recorded as running in it (``summary.during_turn``); a
        rollback or fork to it ends that run as failed. A turn replayed after a crash that asks again for the same
        name gets the checkpoint it already took (the k-th call with a name, the k-th such checkpoint of the turn)."""
        ts, agent, user = b.ts, b.entity.agent, b.entity.user
        if _scope_of(b.manifest) != "user":
            raise InvalidInput(f"agent {agent!r} has one instance per {_scope_of(b.manifest)}; checkpoints are "
                               "taken of per-user instances", hint='set [agent] scope = "user"')
        if await asyncio.to_thread(_keeps_nothing, ts, agent):
            raise InvalidInput(f"agent {agent!r} keeps nothing of its turns (zero retention); a checkpoint would "
                               "keep them", hint="turn zero retention off to checkpoint its users")
        # The k-th call with this name in this execution of the turn: a replay (after a crash) gets the k-th one the
        # turn took before; a turn that asks for the same name again (a loop) gets a new one each time.
        asked = vars(b).setdefault("_checkpoints_asked", {})
        k = asked[name] = asked.get(name, 0) + 1
        took = [ck for ck in await asyncio.to_thread(checkpoints_of(ts).list, agent, user, limit=200)
                if ck.name == name and ck.summary.get("during_turn") == b.turn_id]
        if len(took) >= k:
            return sorted(took, key=lambda ck: ck.seq)[k - 1]
        await tenant_cap.admit(self.rt.config, ts, 0, "a checkpoint")
        ck = await self._take(ts, agent, user, sandbox, kind="manual", name=name, turn_id=None,
                              summary={"during_turn": b.turn_id})
        await self._retain(ts, agent, user, sandbox, ck, Policy.of(b.manifest))
        return ck

    async def rollback(self, principal: Principal, agent: str, user: str, checkpoint_id: str, *,
                       as_scope: str = "provision") -> dict[str, Any]:
        """Put the instance's sandbox and store state back to the checkpoint. The state it leaves is checkpointed
        first (``before-rollback``): the abandoned branch's tip, listable and restorable by another rollback."""
        ts = self._ts(principal, agent, user, as_scope)
        repo = checkpoints_of(ts)
        target = await asyncio.to_thread(repo.restorable, agent, user, checkpoint_id)
        started = time.perf_counter()
        # Refused while an exec runs in the sandbox; the operator's reads and execs arriving meanwhile wait for it.
        async with Gate.of(self.rt).travelling(_key(ts, agent, user), "roll back", _what(agent, user)), \
                self._hold(ts, agent, user) as sandbox:
            # Read again now the instance is held: a turn the rollback waited for may have pruned it meanwhile.
            target = await asyncio.to_thread(repo.restorable, agent, user, checkpoint_id)
            await self._sandbox_half(sandbox, target)
            left = await self._take(ts, agent, user, sandbox, kind="before-rollback",
                                    summary={"rolled_back_to": target.id})
            # The intent first: a host killed between the sandbox's rollback and the store's finishes both later.
            await asyncio.to_thread(repo.set_pending, agent, user, {"op": "rollback", "to": target.id})
            await self._vm_rollback(sandbox, target)
            branch = await asyncio.to_thread(repo.rollback, agent, user, target.id)
            self._forget_cached(ts)
            await self._retain(ts, agent, user, sandbox, left)  # the instance now at the target: it is kept
        ms = round((time.perf_counter() - started) * 1000, 1)
        log.info("instance rolled back", agent=agent, user=user, to=target.id, ms=ms)
        return {"object": "rollback", "agent": agent, "user": user, "rolled_back_to": target.id, "branch": branch,
                "abandoned": {"branch": left.branch, "tip": left.id}, "ms": ms}

    async def fork_now(self, principal: Principal, agent: str, user: str, to_users: Sequence[str],
                       name: str | None = None, *, as_scope: str = "provision") -> dict[str, Any]:
        """``fork`` of the instance as it is now: a manual checkpoint (``name``, if given), then a fork at it. New
        users that cannot be made are refused before the checkpoint is taken."""
        ts = self._ts(principal, agent, user, as_scope)
        check_name(name)
        await check_new_users(ts, agent, user, to_users)
        self.rt.instances.refuse_if_draining("forks")
        # Refused before its checkpoint while an exec runs, and an exec arriving from then on waits for the fork
        # (before, one that came while the checkpoint was taken got the fork refused, and the checkpoint stayed).
        async with Gate.of(self.rt).travelling(_key(ts, agent, user), "fork", _what(agent, user)):
            ck = await self.take(principal, agent, user, name, as_scope=as_scope)
            try:
                return await self._fork(ts, agent, user, ck.id, to_users)
            except Exception:
                # Refused after the checkpoint (a new user taken meanwhile: 409) or failed: the fork made nothing,
                # its checkpoint goes too (it would stay, named, counted against retention, for good).
                await self._drop_taken(ts, agent, user, ck)
                raise

    async def _drop_taken(self, ts: TenantStore, agent: str, user: str, ck: Checkpoint) -> None:
        try:
            gone = await asyncio.to_thread(checkpoints_of(ts).drop, agent, user, ck.id)
            if gone is not None and gone.sandbox_checkpoint:
                async with self._hold(ts, agent, user) as sandbox:
                    if sandbox.id == gone.sandbox_id and _can_delete(sandbox):
                        await sandbox.delete_checkpoint(gone.sandbox_checkpoint)
        except Exception as e:  # noqa: BLE001 - the fork's own error is the one to report
            log.warning("a failed fork's checkpoint could not be removed", agent=agent, user=user, checkpoint=ck.id,
                        error=str(e))

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
        await tenant_cap.admit(self.rt.config, ts, 0, "a fork into new users")
        target = await asyncio.to_thread(checkpoints_of(ts).restorable, agent, user, checkpoint_id)
        started = time.perf_counter()
        with self.rt.templates.fork_template() as template_id:  # the collection leaves it alone while this runs
            return await fork_through(self, ts, agent, user, target, to_users, template_id, started)

    async def recover(self) -> int:
        """At host start, before turns resume: finish every operation a killed host left half done, and mark the
        automatic checkpoints whose files it was still writing behind their turns missing (``_unwritten``)."""
        done = 0
        for ts in await asyncio.to_thread(lambda: list(self.rt.store.operator.tenants())):
            try:
                await self._unwritten(ts)
            except Exception as e:  # noqa: BLE001 - a listing still says such a checkpoint is not restorable
                log.warning("could not check the automatic checkpoints a killed host was writing", error=str(e))
            for agent, user in await asyncio.to_thread(checkpoints_of(ts).pending):
                try:
                    async with self._hold(ts, agent, user):
                        done += 1  # _hold finished it
                except Exception as e:  # noqa: BLE001 - one broken instance must not stop the host
                    log.warning("could not finish an interrupted time-travel operation", agent=agent, user=user,
                                error=str(e))
        return done

    async def _unwritten(self, ts: TenantStore) -> int:
        """Automatic checkpoints of this host's instances whose sandbox files the host that died had not written
        yet (they are written behind the turn's reply): their rows stayed as points to go back to, which a rollback
        refused, and as the tips retention keeps of abandoned branches. Each becomes ``missing`` (nothing is being
        written now: this host just started). Returns how many."""
        if getattr(self.rt.driver, "name", None) not in BEHIND_DRIVERS:
            return 0  # its checkpoints are written whole before their rows: nothing to check (nor to list)
        fleet = getattr(self.rt.instances, "fleet", None)
        repo, n = checkpoints_of(ts), 0
        for ck in await asyncio.to_thread(repo.written_behind):
            rec = await asyncio.to_thread(ts.sandboxes.for_scope, Scope.for_user(ck.agent, ck.user))
            if rec is None or rec.id != ck.sandbox_id:  # another sandbox's: nothing will ever judge it, no mark
                await asyncio.to_thread(repo.written, ck.agent, ck.user, ck.id)
                continue
            if fleet is not None and rec.host not in (None, fleet.host_id):
                continue  # another host's copy: not this host's to judge
            try:
                names = {c.name for c in await (await self.rt.driver.open(rec.id)).checkpoints()}
            except Exception:  # noqa: BLE001 - not on this host's disk: nothing to judge by
                continue
            if ck.sandbox_checkpoint in names:  # written; the host stopped before it cleared the mark
                await asyncio.to_thread(repo.written, ck.agent, ck.user, ck.id)
            elif await asyncio.to_thread(repo.mark_unwritten, ck.agent, ck.user, ck.id,
                                         "the host stopped while this checkpoint's sandbox files were written "
                                         "behind its turn"):
                n += 1
                log.warning("automatic checkpoint never written: marked missing", agent=ck.agent, user=ck.user,
                            checkpoint=ck.id)
        return n

    async def forget(self, ts: TenantStore, agent: str, user: str) -> int:
        return await asyncio.to_thread(checkpoints_of(ts).delete_user, agent, user)


__all__ = ["AUTO_DRIVERS", "CLOSE_WAIT_S", "CheckpointGone", "TimeTravel", "_can_delete"]
