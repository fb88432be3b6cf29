"""Deleting a whole agent (``DELETE /v1/agents/{agent}``), as ``Runtime`` does it.

The agent is marked first (``Agents.mark_deleting``): from then on it takes no new turn, user or deploy (409), and
no deployment goes live on it. Each of its end-users is then forgotten as ``DELETE .../users/{user}`` would (their
turns cancelled, instances destroyed here and, in a fleet, taken from the host that holds them and their shipped
snapshots deleted), then its instances no user owns, its warm pools, and last what the agent kept of its own with
the agent itself, in one store transaction (store/forget_agent.py). A delete cut short (a host stopped) leaves the
agent marked: sending it again finishes it. Keys bound to the agent are revoked: an agent made again under the name
is a new one, and they do not reach it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from moorage.errors import ConflictError, NotFound
from moorage.lifecycle.forget import Release
from moorage.log import get_logger
from moorage.runtime.exec_jobs import ExecJobs
from moorage.store import Principal, TenantStore
from moorage.store.forget_agent import InstancesLeft, forget_agent, users_of
from moorage.usage import tenant_cap

log = get_logger(__name__)

#: How often a long delete says how far it got (users forgotten so far).
PROGRESS_EVERY_S = 1.0

#: Rounds of forgetting what the agent has before the delete gives up (409, "retry"): each finds only what a turn
#: that had passed the agent's check before it was marked made meanwhile.
ROUNDS = 5


class AgentDeletion:
    """``Runtime``'s ``delete_agent`` and ``let_go_agent`` (a part of it: it uses the runtime's store, instances,
    templates and ``_forget``)."""

    store: Any
    instances: Any
    templates: Any
    _memories: dict[str, Any]
    _forget: Any
    _let_go: Any
    _destroy_instance: Any

    async def delete_agent(self, principal: Principal, name: str, *, release: Release | None = None,
                           on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Delete the agent and everything it kept; returns ``{"agent", "deleted", "users", "removed"}``.
        ``on_progress`` hears how it goes (the users forgotten so far, about once a second)."""
        principal.require("deploy")
        say = on_progress or (lambda message: None)
        ts: TenantStore = self.store.tenant(principal)
        agent = await asyncio.to_thread(ts.agents.mark_deleting, name)
        log.info("deleting an agent", agent=agent.name)
        forgotten: set[str] = set()
        removed = revoked = 0
        for _ in range(ROUNDS):
            users, loose = await asyncio.to_thread(self._what_is_left, ts, agent.name)
            if users:
                say(f"forgetting {len(users)} end-users")
            said_at = time.monotonic()
            for i, user in enumerate(users, 1):
                n, _registered = await self._forget(ts, agent.name, user, release)
                removed += n
                forgotten.add(user)
                if time.monotonic() - said_at >= PROGRESS_EVERY_S and i < len(users):
                    said_at = time.monotonic()
                    say(f"end-users forgotten: {i} of {len(users)}")
                    log.info("deleting an agent: users forgotten", agent=agent.name, users=i, of=len(users))
            for rec in loose:  # instances no user owns (a workflow run's without one)
                removed += await self._drop_instance(ts, rec, release)
            await self._drain_pools(ts, agent)
            # Before the agent goes: a delete cut short after it must not leave keys that would reach a new agent
            # of the same name.
            revoked += await asyncio.to_thread(revoke_keys, ts._backend, ts.tenant_id,
                                               lambda k, name=agent.name: k.agent == name)
            say("deleting what the agent kept, its deployments and the agent")
            try:
                removed += await asyncio.to_thread(forget_agent, ts, agent)
                break
            except InstancesLeft:
                continue  # a turn that had passed the check made one meanwhile: once more
        else:
            raise ConflictError(f"agent {agent.name!r} kept getting new instances while it was deleted",
                                hint="retry the delete: the agent takes no new turns now")
        self._memories.pop(ts.tenant_id, None)
        tenant_cap.levels(ts).freed(ts.tenant_id)  # its packages, snapshots and rows: room at once
        self.templates.collect_soon()  # its templates and packages leave this host's disk
        log.info("agent deleted", agent=agent.name, users=len(forgotten), removed=removed, keys_revoked=revoked)
        return {"agent": agent.name, "deleted": True, "users": len(forgotten), "removed": removed}

    async def let_go_agent(self, principal: Principal, name: str) -> int:
        """For a delete of the agent another host serves: put to sleep each instance of the agent this host holds
        awake (its users' turns here cancelled first), so that host can take them. Returns how many slept."""
        principal.require("deploy")
        ts: TenantStore = self.store.tenant(principal)
        recs = await asyncio.to_thread(ts.sandboxes.list, agent_id=name, limit=100_000)
        slept = 0
        for user in sorted({r.scope.user for r in recs if r.scope.user is not None}):
            slept += await self._let_go(ts, name, user)
        for rec in recs:
            li = self.instances.live(ts, rec.scope) if rec.scope.user is None else None
            if li is not None and li.owned:
                slept += await self.instances.sleep(ts, rec.scope, reason="forget")
        return slept

    @staticmethod
    def _what_is_left(ts: TenantStore, agent: str) -> tuple[list[str], list[Any]]:
        """The agent's end-users still named anywhere, and its instances no user owns. Blocking."""
        recs = ts.sandboxes.list(agent_id=agent, limit=100_000)
        users = set(users_of(ts, agent)) | {r.scope.user for r in recs if r.scope.user is not None}
        return sorted(users), [r for r in recs if r.scope.user is None]

    async def _drop_instance(self, ts: TenantStore, rec: Any, release: Release | None) -> int:
        """Destroy one instance no user owns as a forget does each of a user's, then its record and scope."""
        await self._destroy_instance(ts, rec, release)
        ExecJobs.of(self).forget({rec.id})
        await asyncio.to_thread(_delete_record, ts, rec)
        return 1

    async def _drain_pools(self, ts: TenantStore, agent: Any) -> None:
        """Empty this host's warm pools of the agent's templates (forks made ahead for users who will not come)."""
        pool = self.instances.pool
        if pool is None:
            return
        for d in await asyncio.to_thread(ts.deployments.list, agent.id, deleted=True):
            ref = self.templates.cached(d.id)
            if ref is not None:
                await pool.drain(ref.id)


def revoke_keys(backend: Any, tenant_id: str, which: Callable[[Any], bool]) -> int:
    """Revoke the tenant's keys ``which`` picks that are not revoked yet (end-user tokens die with the key that
    issued them); how many. Blocking."""
    keys = [k for k in backend.list_api_keys(tenant_id) if k.revoked_at is None and which(k)]
    for k in keys:
        try:
            backend.revoke_api_key(tenant_id, k.id)
        except NotFound:
            continue
    return len(keys)


def _delete_record(ts: TenantStore, rec: Any) -> None:
    """The record of an instance no user owns, and its scope's rows. Blocking."""
    from moorage.store.tenant import _delete_scopes

    with ts._tx() as c:
        _delete_scopes(c, [rec.scope.key])
        c.x("DELETE FROM sandboxes WHERE id = ?", (rec.id,))
