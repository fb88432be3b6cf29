"""Deleting a whole tenant (``DELETE /v1/tenants/{tenant}``, the operator's), as ``Runtime`` does it.

The tenant is marked (``tenants.deleting_since``) and every key it has is revoked first: from then on no key of
the tenant, and no end-user token one of them issued, is accepted, and no key is made for it. Every agent of the
tenant is then marked and deleted as ``DELETE /v1/agents/{agent}`` does (runtime/agent_delete.py: its users
forgotten, their instances destroyed here and, in a fleet, taken from the host holding them with their shipped
snapshots), then any instance left that no agent owns. Last, what the object store still keeps under the tenant's
``instances/`` prefix, the tenant's store (its SQLite file, or its rows in PostgreSQL), its keys and the tenant
itself. A delete cut short (a host stopped) leaves the tenant marked, its keys revoked: sending it again finishes
it. The fleet's collection never removes the objects of a tenant the store does not list (fleet/gc.py), which is
why the delete removes its own before the tenant's row goes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from moorage.errors import ConflictError, NotFound
from moorage.lifecycle.forget import Release
from moorage.log import get_logger
from moorage.runtime.agent_delete import ROUNDS, revoke_keys
from moorage.store import TenantStore
from moorage.usage import tenant_cap

log = get_logger(__name__)


class TenantDeletion:
    """``Runtime``'s ``delete_tenant`` (a part of it: it uses the runtime's store, instances and ``delete_agent``).

    A tenant delete and an online backup of the host (runtime/backup.py) do not run together: the backup copies
    each tenant's store and instances, which the delete removes under it. Whichever comes second is refused (409)
    until the first is done (``backing_up``, set by the admin socket; ``deleting_tenants``)."""

    store: Any
    instances: Any
    _memories: dict[str, Any]
    delete_agent: Any
    let_go_agent: Any
    _drop_instance: Any
    #: Whether an online backup of this host runs now (runtime/admin_socket.py sets it).
    backing_up: bool
    #: The names or ids of the tenants whose delete runs on this host now.
    deleting_tenants: set[str]

    async def delete_tenant(self, name_or_id: str, *, release: Release | None = None,
                            on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Delete the tenant and everything it kept; returns ``{"tenant", "deleted", "agents", "users",
        "removed", "keys_revoked"}``. ``on_progress`` hears how it goes (each agent, and its users)."""
        if self.backing_up:
            raise ConflictError("an online backup of this host is running; it copies the tenant being deleted",
                                hint="delete the tenant once `moorage backup` is done")
        self.deleting_tenants.add(name_or_id)
        try:
            return await self._delete_tenant(name_or_id, release, on_progress)
        finally:
            self.deleting_tenants.discard(name_or_id)

    async def _delete_tenant(self, name_or_id: str, release: Release | None,
                             on_progress: Callable[[str], None] | None) -> dict[str, Any]:
        say = on_progress or (lambda message: None)
        backend = self.store.backend
        tenant = await asyncio.to_thread(backend.get_tenant, name_or_id)
        tenant = await asyncio.to_thread(backend.mark_tenant_deleting, tenant.id)
        log.info("deleting a tenant", tenant=tenant.id, tenant_name=tenant.name)
        keys = await asyncio.to_thread(revoke_keys, backend, tenant.id, lambda k: True)  # first: nothing gets in
        principal = self.store.operator.principal(tenant.id)
        ts: TenantStore = self.store.tenant(principal)
        agents = users = removed = 0
        for _ in range(ROUNDS):
            names = [a.name for a in await asyncio.to_thread(ts.agents.list)]
            loose = await asyncio.to_thread(ts.sandboxes.list, limit=100_000)
            if not names and not loose:
                break
            for name in names:  # every agent stops taking turns before the first is deleted
                await asyncio.to_thread(ts.agents.mark_deleting, name)
            for i, name in enumerate(names, 1):
                say(f"deleting agent {name} ({i} of {len(names)})")

                def relay(message: str, name: str = name) -> None:
                    say(f"{name}: {message}")

                try:
                    done = await self.delete_agent(principal, name, release=release, on_progress=relay)
                except NotFound:
                    continue  # deleted meanwhile (a delete of the agent sent beside this one)
                agents += 1
                users += int(done["users"])
                removed += int(done["removed"])
            for rec in await asyncio.to_thread(ts.sandboxes.list, limit=100_000):
                if rec.agent_id not in names:  # an instance of no agent the tenant has (an agent's are gone)
                    removed += await self._drop_instance(ts, rec, release)
        else:
            raise ConflictError(f"tenant {tenant.name!r} kept getting new agents or instances while it was deleted",
                                hint="retry the delete: its keys are revoked, so what made them has stopped")
        say("deleting the tenant's store")
        fleet = getattr(self.instances, "fleet", None)
        if fleet is not None:  # what a shipment cut short left (its instance's forget removed the rest)
            removed += await asyncio.to_thread(fleet.objects.delete_prefix, f"instances/{tenant.id}/")
        await asyncio.to_thread(backend.delete_tenant, tenant.id)
        self._memories.pop(tenant.id, None)
        tenant_cap.levels(ts).dropped(tenant.id)
        log.info("tenant deleted", tenant=tenant.id, tenant_name=tenant.name, agents=agents, users=users,
                 removed=removed, keys_revoked=keys)
        return {"tenant": {"id": tenant.id, "name": tenant.name}, "deleted": True, "agents": agents, "users": users,
                "removed": removed, "keys_revoked": keys}

    async def let_go_tenant(self, name_or_id: str) -> int:
        """For a delete of the tenant another host serves: put to sleep every instance of the tenant this host holds
        awake (turns here cancelled first), so that host can take them. Returns how many slept."""
        tenant = await asyncio.to_thread(self.store.backend.get_tenant, name_or_id)
        principal = self.store.operator.principal(tenant.id)
        ts: TenantStore = self.store.tenant(principal)
        agents = {r.agent_id for r in await asyncio.to_thread(ts.sandboxes.list, limit=100_000)}
        return sum([await self.let_go_agent(principal, name) for name in sorted(agents)])

