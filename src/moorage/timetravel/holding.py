"""Holding an agent instance for a time-travel operation the way a turn holds it (its line in the router, its turn in
the instance manager), and finishing first what a killed host left half done: a rollback or a fork's restore."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.log import get_logger
from moorage.store import EntityKey, Scope, TenantStore
from moorage.store.repos.checkpoints import Checkpoint, checkpoints_of

if TYPE_CHECKING:
    from moorage.sandbox import Sandbox

log = get_logger("moorage.timetravel.timeline")

#: What holds an instance's line in the router during a rollback or fork (the source's, and each new user's while
#: the fork makes it): ``Router.holders`` names it, to the online backup for one.
LINE_HOLDER = "-time-travel"


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


def _known_user(ts: TenantStore, agent: str, user: str) -> bool:
    """Whether ``user`` is one of ``agent``'s end-users (registered, or from before users were per agent: a session
    of theirs exists, as ``Router.resolve`` counts them). Raises NotFound for an agent that does not exist."""
    ts.agents.get(agent)
    return ts.agent_users.find(agent, user) is not None or bool(ts.sessions.list(agent, user, limit=1))


class Holding:
    """How ``TimeTravel`` holds an instance (a mixin: the timeline holds its runtime, ``rt``)."""

    rt: Any

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

        async with rt.router._on_instance((ts.tenant_id, scope.key), LINE_HOLDER, scope, lc, exclusive=True):
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
            from moorage.timetravel.auto import _can_delete

            await _settled(lambda: sandbox.rollback(pending["vm"]))
            self.rt._loaded.pop(sandbox.id, None)
            await asyncio.to_thread(repo.set_pending, agent, user, None)
            if _can_delete(sandbox):  # the way back, which no checkpoint row names: as a fork that ends does
                with contextlib.suppress(Exception):
                    await sandbox.delete_checkpoint(pending["vm"])
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
