"""Time to live of sleeping instances: archived after the agent's archive TTL, deleted after its delete TTL.

Deletion destroys the sandbox (its disks and snapshots) through the driver, then drops the instance's row.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moorage.errors import ConflictError, MoorageError
from moorage.lifecycle import machine
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import TraceContext
from moorage.lifecycle.machine import Verb as V
from moorage.log import get_logger
from moorage.sandbox import SandboxNotFound
from moorage.store import SandboxRecord, TenantStore

if TYPE_CHECKING:
    from moorage.lifecycle.manager import InstanceManager

log = get_logger(__name__)


@dataclass(frozen=True)
class TtlReport:
    archived: int
    deleted: int


async def sweep(manager: "InstanceManager", now: float | None = None) -> TtlReport:
    """Archive and delete this host's sleeping instances whose agent's TTLs have passed (``now``: wall clock)."""
    now = time.time() if now is None else now
    archived = deleted = 0
    tenants = await manager.io(lambda: [t.id for t in manager.store.operator.list_tenants()])
    for tid in tenants:
        ts = await manager.io(manager.system_tenant, tid)
        records = await manager.io(ts.sandboxes.list, states=[S.SLEEPING.value, S.ARCHIVED.value, S.FAILED.value],
                                   host=manager.host, limit=100_000)
        lifecycles: dict[str, AgentLifecycle | None] = {}
        for rec in records:
            if rec.agent_id not in lifecycles:
                lifecycles[rec.agent_id] = await manager.io(_lifecycle, ts, rec.agent_id)
            lc = lifecycles[rec.agent_id]
            if lc is None:
                continue
            idle = now - rec.last_active
            try:
                if lc.delete_after_s is not None and idle >= lc.delete_after_s:
                    trace = TraceContext.new()
                    rec = await manager.io(machine.apply, ts, rec, V.DELETE, owner=manager.owner, trace=trace,
                                           reason=f"asleep {idle:.1f}s ≥ delete TTL {lc.delete_after_s:g}s")
                    await finish_delete(manager, ts, rec, trace)
                    deleted += 1
                elif rec.state == S.SLEEPING.value and lc.archive_after_s is not None and idle >= lc.archive_after_s:
                    await manager.io(machine.apply, ts, rec, V.ARCHIVE, owner=manager.owner,
                                     reason=f"asleep {idle:.1f}s ≥ archive TTL {lc.archive_after_s:g}s")
                    archived += 1
            except ConflictError:
                continue  # a request woke it meanwhile: it is not idle any more
    if archived or deleted:
        log.info("ttl sweep", archived=archived, deleted=deleted)
    return TtlReport(archived, deleted)


def _lifecycle(ts: TenantStore, agent: str) -> AgentLifecycle | None:
    try:
        return AgentLifecycle.of(ts.agents.get(agent))
    except MoorageError as e:
        # An agent that is gone or misconfigured keeps its instances until someone looks: never guess a TTL.
        log.warning("no lifecycle config for agent; skipping its instances", agent=agent, error=str(e))
        return None


async def finish_delete(manager: "InstanceManager", ts: TenantStore, rec: SandboxRecord, trace: TraceContext) -> None:
    """The instance is ``deleted``: remove every byte of its sandbox, then its row."""
    with contextlib.suppress(SandboxNotFound):
        sandbox = await manager.driver.open(rec.id)
        await sandbox.destroy()
    if manager.fleet is not None:  # its shipped snapshots too, before the row: a retry still finds what to delete
        await manager.io(manager.fleet.delete_instance, ts.tenant_id, rec)
    with contextlib.suppress(ConflictError):  # another manager finished it first
        await manager.io(machine.remove, ts, rec, owner=manager.owner, trace=trace)
    manager.forget(ts.tenant_id, rec.scope)
    log.info("instance deleted", instance=rec.id, scope=str(rec.scope))
