"""The operator verbs on one instance, as ``Runtime`` does them: sleep and wake its sandbox; checkpoint, roll
back and fork the whole instance (through the timeline); its files and commands; forgetting a user."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, AsyncIterator

from moorage.durable import DurableEngine
from moorage.errors import InvalidInput, NotFound
from moorage.lifecycle.errors import Misplaced
from moorage.lifecycle.forget import Release, take_to_forget
from moorage.lifecycle.config import AgentLifecycle
from moorage.log import get_logger
from moorage.runtime.exec_jobs import ExecJobs
from moorage.sandbox import TemplateRef
from moorage.store import Principal, Scope, TenantStore
from moorage.timetravel.gate import Gate
from moorage.usage import tenant_cap

log = get_logger(__name__)


class OperatorVerbs:
    """``Runtime``'s verbs on an instance by its sandbox id, and ``forget`` (a part of it: it reads the runtime's
    store, driver, instances, templates and timeline)."""

    async def _instance_of(self, principal: Principal, sandbox_id: str) -> tuple[TenantStore, Any, Any]:
        ts = self.store.tenant(principal)
        rec = await asyncio.to_thread(ts.sandboxes.get, sandbox_id)
        if (principal.user is not None and rec.scope.user != principal.user) or \
                (principal.agent is not None and rec.scope.agent != principal.agent):  # the routes check it first
            raise NotFound(f"no sandbox {sandbox_id!r}")
        agent = await asyncio.to_thread(ts.agents.get, rec.scope.agent)
        deployment = await asyncio.to_thread(ts.deployments.get, agent.live_deployment) if agent.live_deployment else None

        async def template() -> TemplateRef:
            if deployment is None:
                raise NotFound(f"agent {agent.name!r} has no live deployment to provision from")
            return await self.templates.ensure(deployment)

        return ts, rec, template

    async def sandbox(self, principal: Principal, sandbox_id: str, verb: str, **kw: Any) -> dict[str, Any]:
        """Operator verbs on one instance's sandbox: sleep and wake; checkpoint, rollback and fork are the whole
        instance's (``timetravel``: the sandbox and the store state of its scopes together, never one without the
        other), of an end-user's instance."""
        principal.require("deploy")
        ts, rec, template = await self._instance_of(principal, sandbox_id)
        if verb in ("checkpoint", "rollback", "fork"):
            return await self._whole_instance(principal, rec, verb, kw.get("checkpoint") or kw.get("label"),
                                              kw.get("to_users"))
        if rec.scope.user is not None:  # a reply just sent: its automatic checkpoint first
            await self.timetravel.settled(ts.tenant_id, rec.scope.agent, rec.scope.user)
        if verb == "sleep":
            slept = await self.instances.sleep(ts, rec.scope, reason="api")
            return {"id": sandbox_id, "slept": slept}
        if verb == "wake":
            # In the instance's line like a turn: a forget of its user (which holds the line) ends before or
            # after, never while the wake brings the sandbox up from the snapshot the forget deletes.
            async with self._in_line(ts, rec.scope):
                await asyncio.to_thread(ts.sandboxes.get, sandbox_id)  # NotFound: its user was forgotten meanwhile
                async with self.instances.turn(ts, rec.scope, template) as sb:
                    return {"id": sandbox_id, "state": sb.state.value}
        raise InvalidInput(f"unknown sandbox verb {verb!r}", hint="sleep, wake, checkpoint, rollback or fork")

    async def _whole_instance(self, principal: Principal, rec: Any, verb: str, ref: str | None,
                              to_users: list[str] | None) -> dict[str, Any]:
        """The sandbox verbs checkpoint, rollback and fork as the timeline's (docs/timetravel.md). A sandbox
        rolled back alone would leave memory, facts and journal where they were: the two would diverge."""
        agent, user = rec.scope.agent, rec.scope.user
        if rec.scope.kind != "user" or user is None:
            raise InvalidInput(f"sandbox {rec.id} is a {rec.scope.kind}'s instance; checkpoints, rollbacks and forks "
                               "are of one end-user's whole instance (its sandbox and its memory together)",
                               hint='set [agent] scope = "user" (the default) to checkpoint instances')
        tt = self.timetravel
        if verb == "checkpoint":
            ck = await tt.take(principal, agent, user, ref, as_scope="deploy")
            return {"id": rec.id, "checkpoint": ck.id, "name": ck.name, "agent": agent, "user": user}
        if verb == "rollback":
            if not ref:
                raise InvalidInput("name the checkpoint to roll back to", hint='{"checkpoint": "<its id or name>"}')
            target = await tt.find(principal, agent, user, ref, as_scope="deploy")
            out = await tt.rollback(principal, agent, user, target.id, as_scope="deploy")
            return {"id": rec.id, **out}
        if not to_users:
            raise InvalidInput("name the new end-users the instance is forked into",
                               hint='{"to_users": ["..."]}: each starts as this one is now (sandbox and memory)')
        return {"id": rec.id, **await tt.fork_now(principal, agent, user, to_users, ref, as_scope="deploy")}

    # The reads and execs wait for a rollback or fork of the instance in progress and then see where it left it;
    # a rollback or fork asked for while an exec runs is refused (``timetravel/gate.py``, docs/timetravel.md).

    async def list_files(self, principal: Principal, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        ts, rec, template = await self._instance_of(principal, sandbox_id)
        async with Gate.of(self).reading((ts.tenant_id, rec.scope.key)):
            async with self.instances.turn(ts, rec.scope, template) as sb:
                return [{"name": f.name, "path": f.path, "type": f.type, "size": f.size, "mtime": f.mtime}
                        for f in await sb.list_files(path)]

    async def read_file(self, principal: Principal, sandbox_id: str, path: str) -> bytes:
        ts, rec, template = await self._instance_of(principal, sandbox_id)
        async with Gate.of(self).reading((ts.tenant_id, rec.scope.key)):
            async with self.instances.turn(ts, rec.scope, template) as sb:
                return await sb.read_file(path)

    async def exec(self, principal: Principal, sandbox_id: str, argv: list[str], *, execution: str | None = None,
                   **kw: Any) -> Any:
        """Run a command in one instance's sandbox, held awake until it ends (detached: ``runtime.exec_jobs``, which
        names its ``execution``)."""
        principal.require("deploy")
        ts, rec, template = await self._instance_of(principal, sandbox_id)
        async with Gate.of(self).executing((ts.tenant_id, rec.scope.key), argv, kw.get("timeout"), execution):
            async with self.instances.turn(ts, rec.scope, template) as sb:
                return await sb.exec(argv, **kw)

    async def forget(self, principal: Principal, agent: str, user: str) -> int:
        """Remove everything about one user of one agent: memory tiers, runs, journal, traces, sandboxes, snapshots."""
        return (await self.erase(principal, agent, user))[0]

    async def erase(self, principal: Principal, agent: str, user: str, *,
                    release: Release | None = None) -> tuple[int, bool]:
        """``forget``, and whether the user was registered (unregistered with the rest, while their instance is
        held: a registration that came just before the forget is forgotten too, and said so). ``release`` asks
        another live host to let go of an instance of theirs it holds awake (``let_go`` there; lifecycle/forget.py)."""
        principal.require("provision")
        return await self._forget(self.store.tenant(principal), agent, user, release)

    async def let_go(self, principal: Principal, agent: str, user: str) -> int:
        """For a forget of the user another host serves (it holds their lines there): cancel their turns here and
        put to sleep each of their instances this host holds awake, so that host can take them
        (lifecycle/forget.py). Returns how many slept."""
        principal.require("provision")
        return await self._let_go(self.store.tenant(principal), agent, user)

    async def _let_go(self, ts: TenantStore, agent: str, user: str) -> int:
        recs = await self._instances_of_user(ts, agent, user)
        slept = 0
        async with self._held_to_forget(ts, agent, user, recs):
            for rec in recs:
                li = self.instances.live(ts, rec.scope)
                if li is not None and li.owned:
                    slept += await self.instances.sleep(ts, rec.scope, reason="forget")
        return slept

    async def forget_in(self, ts: TenantStore, agent: str, user: str) -> int:
        """``forget`` in a tenant already authorized (a fork undoing the users it made)."""
        return (await self._forget(ts, agent, user))[0]

    async def _forget(self, ts: TenantStore, agent: str, user: str,
                      release: Release | None = None) -> tuple[int, bool]:
        await self.timetravel.settled(ts.tenant_id, agent, user)  # a checkpoint being taken after a reply
        recs = await self._instances_of_user(ts, agent, user)
        # Held like a turn: a turn of theirs in flight is cancelled and ends first, a rollback or fork of them
        # ends first, and what arrives meanwhile waits. Destroying the sandbox under a running turn failed it
        # with a 502, and a rollback that finished after the forget wrote the user's rows back.
        async with self._held_to_forget(ts, agent, user, recs):
            recs = await self._instances_of_user(ts, agent, user)  # one a turn that ran first provisioned
            for rec in recs:
                await self._destroy_instance(ts, rec, release)
            ExecJobs.of(self).forget({rec.id for rec in recs})  # their detached execs' output held here
            removed = await self.templates.delete_forks(ts.tenant_id, agent, user)  # snapshots of their instances
            removed += await self.timetravel.forget(ts, agent, user)  # their checkpoints (purged with the rest below)
            removed += await asyncio.to_thread(ts.forget_user, user, agent)
            # Unregistered while held: a turn of theirs that waited in line behind the forget finds them gone and
            # is refused (``Router.route``) rather than running for a user who no longer exists.
            deleted = await asyncio.to_thread(ts.agent_users.delete, agent, user)
            self._memories.pop(ts.tenant_id, None)  # drop cached vectors of the forgotten user
            tenant_cap.levels(ts).freed(ts.tenant_id)  # room under the tenant's storage ceiling from its next write
        return removed + len(recs), deleted

    async def _destroy_instance(self, ts: TenantStore, rec: Any, release: Release | None) -> None:
        """Put a forgotten instance to sleep, take it (from the host that holds it, with ``release``), destroy its
        sandbox here and its shipped snapshots; its record goes with its scope's rows, after."""
        try:
            await self.instances.sleep(ts, rec.scope, reason="forget")
        except Misplaced:
            if release is None:
                raise  # the forget goes to the host that holds it
            # held by another host: take_to_forget has it stopped there first
        # No other host wakes it now (docs/fleet.md).
        await take_to_forget(self.instances, ts, rec, release)
        try:
            sb = await self.driver.open(rec.id)
            await sb.destroy()
        except Exception as e:  # already gone on this host
            log.info("sandbox not on this host while forgetting", sandbox=rec.id, error=str(e))
        if self.instances.fleet is not None:  # its shipped snapshots in the object store
            await asyncio.to_thread(self.instances.fleet.delete_instance, ts.tenant_id, rec)
        self.instances.forget(ts.tenant_id, rec.scope)

    async def _instances_of_user(self, ts: TenantStore, agent: str, user: str) -> list[Any]:
        return await asyncio.to_thread(ts.sandboxes.of_user, agent, user)

    @contextlib.asynccontextmanager
    async def _held_to_forget(self, ts: TenantStore, agent: str, user: str, recs: list[Any]) -> AsyncIterator[None]:
        """The user's instances held in their lines in the router, whatever the agent's concurrency (a forget
        waits, it is never refused as busy), their turns on this host cancelled until then (each caller gets
        409 run-cancelled: what the turn would reply is about to be forgotten)."""
        def theirs() -> list[Any]:
            return [b for b in self.turns.values() if b.ts.tenant_id == ts.tenant_id and b.entity.agent == agent
                    and b.entity.user == user]

        async def cancel_theirs() -> None:
            # Until the lines are held: a turn that held its line before its run began is cancelled as it begins.
            while True:
                for b in theirs():
                    try:
                        run = await asyncio.to_thread(DurableEngine(ts).cancel, b.run_id, "its user was forgotten")
                    except NotFound:
                        continue
                    if run.status == "cancelled" and b.reader is not None:  # not one that finished meanwhile
                        b.reader.cancel()
                await asyncio.sleep(0.05)

        scopes = {s.key: s for s in [Scope.for_user(agent, user), *(r.scope for r in recs)]}
        canceller = asyncio.create_task(cancel_theirs())
        async with contextlib.AsyncExitStack() as held:
            try:
                for key in sorted(scopes):  # one order for every forget: two of them never wait on each other
                    await held.enter_async_context(self._in_line(ts, scopes[key]))
                # An agent whose turns run side by side holds no line: its cancelled turns are waited for here.
                deadline = time.monotonic() + 30
                while theirs() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            finally:
                canceller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await canceller
            yield

    @contextlib.asynccontextmanager
    async def _in_line(self, ts: TenantStore, scope: Scope) -> AsyncIterator[None]:
        """An operator verb in the instance's line in the router, after the turns before it, whatever the agent's
        concurrency (it waits; it is never refused as busy)."""
        agent_rec = await asyncio.to_thread(ts.agents.get, scope.agent)
        lc = dataclasses.replace(AgentLifecycle.of(agent_rec), concurrency="queue", max_queue=1 << 30)
        async with self.router._on_instance((ts.tenant_id, scope.key), "-operator", scope, lc):
            yield
