"""Host-restart recovery: every instance the store places on this host is moved out of in-between states.

Live sandboxes are re-adopted via ``driver.open``; dead ones are marked sleeping (their disk is the snapshot),
half-made ones failed (the next request provisions again), half-deleted ones finished.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moorage.errors import ConflictError
from moorage.lifecycle import machine
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import TraceContext
from moorage.lifecycle.machine import Verb as V
from moorage.lifecycle.ttl import finish_delete
from moorage.log import get_logger
from moorage.sandbox import SandboxNotFound, SandboxState
from moorage.store import SandboxRecord, TenantStore

if TYPE_CHECKING:
    from moorage.lifecycle.manager import InstanceManager

log = get_logger(__name__)

_UNSETTLED = (S.RUNNING, S.WAKING, S.SUSPENDING, S.PROVISIONING, S.DELETED)


@dataclass
class RecoveryReport:
    adopted: list[str] = field(default_factory=list)
    slept: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: Still claimed by a live manager process on this host: left to it.
    left: list[str] = field(default_factory=list)


def _owner_alive(rec: SandboxRecord, manager: "InstanceManager") -> bool:
    """Whether a live manager process (other than us) is responsible for this record right now."""
    holder = machine.claim_of(rec) if S(rec.state) in machine.CLAIMED_STATES else rec.meta.get("owner")
    if not isinstance(holder, dict) or holder.get("owner") == manager.owner.id:
        return False
    probe = SandboxRecord(**{**rec.__dict__, "meta": {"claim": holder}})
    # An owner of a running instance does not time out: only its death frees the instance.
    timeout = manager.claim_timeout_s if S(rec.state) in machine.CLAIMED_STATES else float("inf")
    return not machine.claim_is_dead(probe, manager.owner, timeout)


async def recover(manager: "InstanceManager") -> RecoveryReport:
    report = RecoveryReport()
    tenants = await manager.io(lambda: [t.id for t in manager.store.operator.list_tenants()])
    for tid in tenants:
        ts = await manager.io(manager.system_tenant, tid)
        records = await manager.io(ts.sandboxes.list, states=[s.value for s in _UNSETTLED], host=manager.host, limit=100_000)
        for rec in records:
            if _owner_alive(rec, manager):
                report.left.append(rec.id)
                continue
            try:
                await _settle(manager, ts, rec, report)
            except ConflictError:
                report.left.append(rec.id)  # another manager settled it at the same moment
    log.info("recovery done", adopted=len(report.adopted), slept=len(report.slept), failed=len(report.failed),
             deleted=len(report.deleted), left=len(report.left))
    return report


async def _settle(manager: "InstanceManager", ts: TenantStore, rec: SandboxRecord, report: RecoveryReport) -> None:
    trace = TraceContext.new()
    state = S(rec.state)
    if state is S.DELETED:
        await finish_delete(manager, ts, rec, trace)
        report.deleted.append(rec.id)
        return
    if state is S.PROVISIONING:
        with contextlib.suppress(SandboxNotFound):
            await (await manager.driver.open(rec.id)).destroy()
        await manager.io(machine.apply, ts, rec, V.FAIL, owner=manager.owner, trace=trace, reason="host restarted mid-provision")
        report.failed.append(rec.id)
        return
    try:
        sandbox = await manager.driver.open(rec.id)
    except SandboxNotFound:
        verb = V.FAIL if state is S.RUNNING else V.RECOVER
        await manager.io(machine.apply, ts, rec, verb, owner=manager.owner, trace=trace, reason="sandbox missing on disk")
        (report.failed if verb is V.FAIL else report.slept).append(rec.id)
        return
    if sandbox.state is SandboxState.RUNNING:
        li = manager._live_for(ts, rec.scope, None)
        meta = {**rec.meta, "owner": manager.owner.claim()}
        rec = await manager.io(machine.apply, ts, rec, V.ADOPT, owner=manager.owner, trace=trace, claim=False, meta=meta,
                               reason="sandbox alive after host restart")
        manager._adopted(li, rec, sandbox)
        report.adopted.append(rec.id)
        return
    # Its processes are gone; its disk (and memory snapshot, where the driver keeps one) is what it wakes from.
    meta = {k: v for k, v in rec.meta.items() if k != "owner"}
    await manager.io(machine.apply, ts, rec, V.RECOVER, owner=manager.owner, trace=trace, claim=False, meta=meta,
                     reason=f"sandbox {sandbox.state.value} after host restart")
    report.slept.append(rec.id)
