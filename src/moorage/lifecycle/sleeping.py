"""The instance manager's sleep path: sleep an idle instance (on request, by its policy, or to make room on the host
or within its tenant's awake limit), record the sleep with its metered usage, and the idle and TTL loops."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from moorage.errors import ConflictError, MoorageError, StoreUnreachable, UnavailableError, disk_full
from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle import machine
from moorage.lifecycle.capacity import AwakeInstance, CapacityExhausted, HostCapacity
from moorage.lifecycle.errors import Misplaced, TenantAwakeLimit
from moorage.lifecycle.instance import LiveInstance
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import Owner, TraceContext
from moorage.lifecycle.machine import Verb as V
from moorage.log import FailingRounds, get_logger
from moorage.observability import events
from moorage.sandbox import SandboxState
from moorage.store import SandboxRecord, Scope, TenantStore
from moorage.store.base import StoreContention
from moorage.usage import ledger as usage_ledger
from moorage.usage import tenant_cap

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember
    from moorage.sandbox import SandboxDriver

log = get_logger("moorage.lifecycle.manager")


def failed_outcome(e: BaseException) -> str:
    """The ``outcome`` label of a sleep or wake that raised ``e``: ``disk-full`` (the host's disk had no room for its
    snapshot or its record), ``store-unreachable`` (PostgreSQL did not answer), else ``failed``."""
    if disk_full(e) is not None:
        return "disk-full"
    if isinstance(e, StoreUnreachable):
        return "store-unreachable"
    return "failed"


class Sleeping:
    """The sleep path of ``InstanceManager`` (a mixin: the manager holds the state named below)."""

    owner: Owner
    host: str
    fleet: "FleetMember | None"
    capacity: HostCapacity
    tenant_max_awake: int | None
    clock: Callable[[], float]
    tick_s: float
    ttl_every_s: float
    settle: Callable[[str, Scope], Any] | None
    _closed: bool
    _counts: dict[str, int]
    _idle_unreachable: FailingRounds
    _live: dict[tuple[str, str], LiveInstance]
    _dir_locks: dict[str, asyncio.Lock]
    _drop: Callable[[LiveInstance], None]
    driver: "SandboxDriver"
    release_after_s: float
    note_unshipped: Callable[[], None]
    io: Callable[..., Any]
    system_tenant: Callable[[str], TenantStore]
    live: Callable[[TenantStore, Scope], LiveInstance | None]
    awake_instances: Callable[[], list[AwakeInstance]]
    _give_up: Callable[..., Any]
    _awake_elsewhere: Callable[[str, Scope], int]
    ship_unshipped: Callable[[], Any]
    record_now: Callable[[TenantStore, str], Callable[[], SandboxRecord | None]]
    claim_timeout_s: float
    _record_later: Callable[..., None]

    def _mark_slept(self, ts: TenantStore, rec: SandboxRecord, trace: TraceContext, meta: dict[str, Any],
                    snapshot_ref: str, started: float, reason: str, sizes: dict[str, int] | None = None,
                    slept_at: float | None = None) -> SandboxRecord:
        """Record the sleep and, in the same transaction, the awake seconds since the instance was marked running
        (per agent and end-user, measured from state changes, not estimated). The instance has slept already: a
        transaction the store aborted for a conflict with a concurrent one (its ledger rows are shared with other
        instances' sleeps and forgets) runs again, up to 3 times, rather than leave the instance claimed, and every
        turn for it waiting, until its claim lapses."""
        for attempt in range(3):
            try:
                with ts.transaction():
                    new = machine.apply(ts, rec, V.SLEPT, owner=self.owner, trace=trace, claim=False, meta=meta,
                                        snapshot_ref=snapshot_ref, last_active=time.time(), started_at=started,
                                        reason=reason)
                    since = rec.meta.get("awake_since")
                    if isinstance(since, (int, float)):
                        # Up to its snapshot (``slept_at``), not to this record: one the store took only once it was
                        # back (``_record_when_back``) billed the outage as awake time.
                        end = time.time() if slept_at is None else slept_at
                        ts.usage.add("compute_seconds", max(0.0, end - since), agent_id=rec.scope.agent,
                                     user_id=rec.scope.user, scope=rec.scope,
                                     meta={"instance": rec.id, "reason": reason})
                    usage_ledger.record(ts, rec, sizes or {})
                # Counted under the tenant's storage ceiling at once, until its next measure (over: its level
                # before this sleep is still in that measure, which replaces both).
                tenant_cap.levels(ts).grew(ts.tenant_id, sum((sizes or {}).values()))
                return new
            except StoreContention:
                if attempt == 2:
                    raise
                time.sleep(0.02 * (attempt + 1))  # a worker thread (``io``): the loop is not held
        raise AssertionError("unreachable")

    def _record_when_back(self, li: LiveInstance, ts: TenantStore, rec: SandboxRecord, trace: TraceContext,
                          *slept: Any) -> None:
        """The instance slept (its snapshot is on this disk) but the store could not take the record (unreachable,
        or its disk full): recorded once it can (``_record_later``)."""
        async def record() -> None:
            try:
                await self.io(self._mark_slept, ts, rec, trace, *slept)
            except ConflictError:  # recorded after all (the reply was lost), or reclaimed once the claim lapsed
                return
            if slept[0].get("shipped_current") is False:
                self.note_unshipped()
            if li.record_id == rec.id and li.sandbox is None:
                li.owned = False
            log.info("instance slept (recorded once the store was back)", instance=rec.id, scope=str(li.scope))

        self._record_later(f"record-sleep-{rec.id}", record,
                           lambda e: isinstance(e, StoreUnreachable) or disk_full(e) is not None)

    def _give_up_when_room(self, ts: TenantStore, rec: SandboxRecord, trace: TraceContext, reason: str) -> None:
        """A sleep that failed could not be recorded failed either, the disk being full: recorded once there is room
        (``_record_later``)."""
        async def record() -> None:
            try:
                await self._give_up(ts, rec, trace, reason)
            except Exception as e:  # noqa: BLE001 - still full: again; anything else: the claim lapses instead
                if disk_full(e) is not None:
                    raise
                log.warning("a failed sleep could not be recorded", instance=rec.id, error=str(e))

        self._record_later(f"record-sleep-failed-{rec.id}", record, lambda e: disk_full(e) is not None)

    async def sleep(self, ts: TenantStore, scope: Scope, *, reason: str = "requested") -> bool:
        """Sleep one instance now if this manager owns it and no turn is in flight; returns whether it slept."""
        if self.settle is not None:
            await self.settle(ts.tenant_id, scope)
        li = self.live(ts, scope)
        if (li is None or not li.owned) and self.fleet is not None:
            rec = await self.io(ts.sandboxes.for_scope, scope)
            if rec is not None and rec.host not in (None, self.host) and \
                    await self.io(fleet_rules.placement, self.fleet, rec) == "forward":
                raise Misplaced(rec)  # awake on another host: that host sleeps it
        return False if li is None else await self._sleep(li, reason)

    async def _sleep(self, li: LiveInstance, reason: str, *, evict: bool = False) -> bool:
        if li.activity.busy or not li.owned or li.sandbox is None or li.pending is not None:
            return False
        ts = await self.io(self.system_tenant, li.tenant_id)
        trace = TraceContext.new()
        async with li.op_lock:
            # Re-checked under the lock: a turn may have arrived while we waited for it.
            if li.activity.busy or li.sandbox is None or li.record_id is None:
                return False
            rec = await self.io(ts.sandboxes.get, li.record_id)
            if rec.state != S.RUNNING.value or (rec.meta.get("owner") or {}).get("owner") != self.owner.id:
                li.owned, li.sandbox = False, None  # someone else moved it: it is no longer ours to sleep
                return False
            started = time.time()
            try:
                return await self._sleep_claimed(li, ts, rec, trace, reason, started, evict)
            except Exception as e:
                # Every sleep that failed is counted, with why: the sandbox's own sleep, or the store's record of
                # its claim or its outcome (a full disk, a store that cannot be reached). Only the sandbox's own
                # failure was counted before: a sleep the store stopped did not show in moorage_sleep_seconds.
                events.lifecycle("sleep", failed_outcome(e), started)
                raise

    async def _sleep_claimed(self, li: LiveInstance, ts: TenantStore, rec: SandboxRecord, trace: TraceContext,
                             reason: str, started: float, evict: bool) -> bool:
        """``_sleep`` from its claim on: under the instance's lock, its record read as running and ours."""
        try:
            rec = await self.io(machine.apply, ts, rec, V.CLAIM_SLEEP, owner=self.owner, trace=trace, reason=reason)
        except ConflictError:
            return False
        if li.activity.busy:
            # A turn arrived while the claim was written: hand the instance straight back to it.
            await self.io(machine.apply, ts, rec, V.ADOPT, owner=self.owner, trace=trace, claim=False,
                          reason="turn arrived during sleep claim")
            return False
        sandbox = li.sandbox
        assert sandbox is not None  # checked under the instance's lock (``_sleep``), which is still held
        li.sandbox = None
        # Stopped by itself (its agent's code ended its process, it was killed for memory, the host stopped a
        # stuck guest): it sleeps as its disk, which is where its next turn starts it from.
        stopped = sandbox.state is SandboxState.STOPPED
        try:
            snap = await sandbox.sleep()
            slept_at = time.time()  # its awake time ends here (not at the shipping, nor at the record)
        except Exception as e:
            log.error("instance failed to sleep", instance=rec.id, error=str(e))
            try:
                await self._give_up(ts, rec, trace, f"sleep failed: {e}")
            except Exception as e2:
                if disk_full(e2) is None:
                    raise
                self._give_up_when_room(ts, rec, trace, f"sleep failed: {e}")
                raise
            full = disk_full(e)
            if full is not None:  # said as such (a requested sleep answered "slept": false, an eviction that
                raise full from e  # kept failing "idle instances kept getting new turns")
            events.lifecycle("sleep", failed_outcome(e), started)
            return False
        meta = {k: v for k, v in rec.meta.items() if k not in ("owner", "awake_since")}
        # The habits a policy learned (idle gaps) go with the record, so a restarted host still knows them.
        # With when it became idle and who slept it: if this process releases it (``release_asleep``), the
        # gap until its next turn is still learned (``restore_activity``).
        meta["activity"] = {"turns": li.activity.turns, "gaps": li.activity.gaps.to_dict(),
                            "idle_since": li.activity.idle_since, "slept_by": self.owner.id}
        if self.fleet is not None:
            # Acknowledged only once durable in the object store; if shipping fails the sleep still stands
            # and this host (whose disk has the newest copy) keeps serving it.
            try:
                meta["shipped"] = await self.io(self.fleet.ship, ts.tenant_id, rec, rec.lease_epoch,
                                                held=self.record_now(ts, rec.id))
                meta["shipped_current"] = True
            except Exception as e:
                meta["shipped_current"] = False
                self.note_unshipped()  # shipped later, once the object store is back (_ship_loop)
                log.error("snapshot could not be shipped; it stays on this host", instance=rec.id, error=str(e))
        sizes = await usage_ledger.measure(sandbox)  # disk and snapshot bytes, metered with the sleep
        try:
            await self.io(self._mark_slept, ts, rec, trace, meta, str(snap.path), started, reason, sizes, slept_at)
        except Exception as e:
            if not isinstance(e, StoreUnreachable) and disk_full(e) is None:
                raise
            self._record_when_back(li, ts, rec, trace, meta, str(snap.path), started, reason, sizes, slept_at)
            raise
        if meta.get("shipped_current") is False:
            self.note_unshipped()  # recorded now: a pass that listed the records before it did not see it
        li.owned = False
        self._counts["evictions" if evict else "sleeps"] += 1
        events.lifecycle("sleep", "ok", started)
        if stopped:
            log.info("instance slept: its sandbox had stopped, so its memory was gone already; its next turn "
                     "starts it from its disk", instance=rec.id, scope=str(li.scope), reason=reason)
        else:
            log.info("instance slept", instance=rec.id, scope=str(li.scope), reason=reason)
        return True

    async def sleep_all(self, reason: str, *, wait_busy_s: float = 0.0) -> tuple[int, int]:
        """Sleep every instance this manager owns that is awake (a few at a time), waiting up to ``wait_busy_s``
        for turns in flight to end first. Returns (slept, still awake). For a host that stops cleanly."""
        gate = asyncio.Semaphore(8)
        deadline = time.monotonic() + wait_busy_s

        async def one(li: LiveInstance) -> bool:
            while li.activity.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            async with gate:
                try:
                    return await self._sleep(li, reason)
                except Exception as e:  # one instance must not keep the others awake
                    log.warning("sleep at shutdown failed", scope=str(li.scope), error=str(e))
                    return False

        mine = [li for li in list(self._live.values()) if li.owned and li.awake]
        done = await asyncio.gather(*(one(li) for li in mine))
        slept = sum(done)
        if self.fleet is not None:
            try:  # a host leaving takes its disk along: what slept unshipped earlier goes to the object store now
                await self.ship_unshipped()
            except Exception as e:
                log.warning("shipping sleeping instances failed", error=str(e))
        return slept, len(mine) - slept

    async def _make_room(self, li: LiveInstance) -> None:
        """Sleep least-recently-active idle instances until one more fits the host's capacity."""
        for _ in range(8):
            me = f"{li.tenant_id}/{li.scope.key}"
            awake = [a for a in self.awake_instances() if a.instance_id != me]
            victims = self.capacity.victims(awake, incoming=1, incoming_ram_mib=li.ram_mib)
            if not victims:
                return
            by_id = {f"{x.tenant_id}/{x.scope.key}": x for x in self._live.values()}
            for v in victims:
                await self._sleep(by_id[v], "host capacity: least recently active", evict=True)
        raise CapacityExhausted("could not make room on this host: its idle instances kept getting new turns",
                                hint="retry shortly or raise the host's capacity")

    async def _tenant_room(self, li: LiveInstance) -> None:
        """Before bringing an instance up (no claim taken yet): keep its tenant within ``tenant_max_awake`` by
        sleeping the tenant's least recently active idle instance here; all of them busy: ``TenantAwakeLimit``. In a
        fleet the limit counts the tenant's instances awake on every host (read from the store)."""
        if self.tenant_max_awake is None:
            return
        for _ in range(8):
            me = f"{li.tenant_id}/{li.scope.key}"
            mine = [a for a in self.awake_instances() if a.instance_id != me and a.instance_id.startswith(f"{li.tenant_id}/")]
            here = self.tenant_max_awake
            if self.fleet is not None:
                here -= await self.io(self._awake_elsewhere, li.tenant_id, li.scope)
                if here <= 0:
                    raise TenantAwakeLimit(self.tenant_max_awake, fleet=self.fleet is not None)
            try:
                victims = HostCapacity(max_awake=here).victims(mine, incoming=1)
            except CapacityExhausted as e:
                raise TenantAwakeLimit(self.tenant_max_awake, fleet=self.fleet is not None) from e
            if not victims:
                return
            by_id = {f"{x.tenant_id}/{x.scope.key}": x for x in self._live.values()}
            for v in victims:
                await self._sleep(by_id[v], "tenant's awake limit: least recently active", evict=True)
        raise TenantAwakeLimit(self.tenant_max_awake, fleet=self.fleet is not None)

    async def tick(self) -> int:
        """One pass of the sleep policy over every idle instance this manager owns; returns how many slept."""
        slept, tried, unreachable = 0, False, None
        for li in list(self._live.values()):
            if not li.owned or li.sandbox is None or li.activity.busy:
                continue
            decision = li.policy.decide(li.activity, self.clock())
            # A guest that stopped by itself (its agent's code ended its process, it was killed for memory or from
            # outside, the host stopped it at a turn's timeout) sleeps as its disk now: its awake period, billed as
            # compute_seconds and counted by the compute cap, ends here. Its record stayed running before, and the
            # time it was stopped was billed as awake until its user's next turn, however much later that came.
            reason = "its guest stopped" if li.sandbox.state is SandboxState.STOPPED else \
                decision.reason if decision.sleep_now else None
            if reason is not None:
                try:
                    slept += await self._sleep(li, reason)
                    tried = True
                except UnavailableError as e:  # the store out of reach: said once for the round, below
                    unreachable = e
                except MoorageError as e:
                    log.warning("idle sleep failed", scope=str(li.scope), error=str(e))
        if unreachable is not None:
            self._idle_unreachable.failed(unreachable)
        elif tried:
            self._idle_unreachable.ok()
        return slept

    def release_asleep(self) -> int:
        """Drop from this process's memory the instances asleep and untouched for ``release_after_s``: a host keeps
        what it holds per instance for those it may serve soon, not for every user it ever served (weeks of new
        users held ~13 KiB each until a restart). The store has the rest; a later turn reads it back."""
        now = self.clock()
        released = [li for li in self._live.values()
                    if not li.owned and li.sandbox is None and li.pending is None and li.gate is None
                    and li.peer_driver is None and not li.activity.busy and not li.op_lock.locked()
                    and (li.ship_task is None or li.ship_task.done())
                    and not (li.record_id in self._dir_locks and self._dir_locks[li.record_id].locked())
                    and now - li.activity.last_active >= self.release_after_s]
        for li in released:
            self._drop(li)
            if li.record_id is not None:
                self.driver.forget_handle(li.record_id)
        return len(released)

    async def _idle_loop(self) -> None:
        failures = FailingRounds(log, "idle loop pass")
        while not self._closed:
            try:
                await self.tick()
                failures.ok()
            except Exception as e:  # the loop must outlive one bad instance
                failures.failed(e)
            await asyncio.sleep(self.tick_s)

    async def _ttl_loop(self) -> None:
        from moorage.lifecycle.ttl import sweep

        failures = FailingRounds(log, "ttl sweep")
        while not self._closed:
            await asyncio.sleep(self.ttl_every_s)
            try:
                self.release_asleep()
                await sweep(self)
                failures.ok()
            except Exception as e:
                failures.failed(e)
