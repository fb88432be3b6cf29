"""The instance manager, one per host process: provisions, wakes (single-flight), sleeps idle instances, evicts LRU.

The store is the source of truth for every instance's state and placement; process memory only caches open
sandboxes and tracks turns in flight (so an instance mid-turn is never slept or evicted).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar, Union

from moorage.errors import ConflictError, InvalidInput, MoorageError, UnavailableError
from moorage.fleet.forward import forwarded
from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle import machine
from moorage.lifecycle.capacity import AwakeInstance, CapacityExhausted, HostCapacity
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import Owner, TraceContext
from moorage.lifecycle.machine import Verb as V
from moorage.lifecycle.pool import WarmPool
from moorage.lifecycle.policies import (FixedTimeout, IdleGapHistogram, InstanceActivity, SleepEconomics, SleepPolicy,
                                        parse_policy)
from moorage.log import get_logger
from moorage.sandbox import Sandbox, SandboxDriver, SandboxNotFound, SandboxState, TemplateRef
from moorage.store import FORKED_FROM, SHARED_TEMPLATE, SandboxRecord, Scope, Store, TenantStore
from moorage.usage import ledger as usage_ledger

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember

log = get_logger(__name__)
T = TypeVar("T")

#: What to provision from: a template, or an async callable that finds one (only called when one is needed).
TemplateSource = Union[TemplateRef, Callable[[], Awaitable[TemplateRef]], None]


async def _resolve(template: TemplateSource) -> TemplateRef | None:
    if template is None or isinstance(template, TemplateRef):
        return template
    return await template()


class Misplaced(UnavailableError):
    """The instance lives on another host (its disk and snapshot are there); this host cannot serve it."""

    code = "instance-misplaced"

    def __init__(self, record: SandboxRecord | None, host: str | None = None) -> None:
        where = host if record is None else record.host
        what = "this instance" if record is None else f"instance of {record.scope}"
        super().__init__(f"{what} is placed on host {where!r}", hint=f"route requests for this agent to host {where!r}")
        self.host = where


class TenantAwakeLimit(MoorageError):
    """The tenant already has its maximum of awake instances on this host, every one of them mid-turn."""

    code = "tenant-awake-limit"
    http_status = 429

    def __init__(self, limit: int) -> None:
        super().__init__(f"this tenant already has {limit} awake instance(s) on this host, all busy",
                         hint="retry when a turn ends, or ask the operator to raise max_awake_per_tenant")
        #: Read by the API's problem+json: a turn usually ends within seconds.
        self.retry_after = 5.0


class WakeFailed(UnavailableError):
    """Provisioning or waking a sandbox failed; the instance is marked failed and the next request retries."""

    code = "wake-failed"


@dataclass(eq=False)
class LiveInstance:
    """What this process knows about one instance beyond the store: its open sandbox and its turns in flight."""

    tenant_id: str
    scope: Scope
    activity: InstanceActivity
    policy: SleepPolicy
    ram_mib: int
    record_id: str | None = None
    sandbox: Sandbox | None = None
    #: This manager woke or provisioned it, so this manager (and only it) sleeps or evicts it.
    owned: bool = False
    #: Serialises this process's sleep and wake of the instance.
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The in-process single flight: every concurrent caller awaits this one bring-up.
    pending: "asyncio.Future[Sandbox] | None" = None
    #: A second driver view used to attach to an instance another live process on this host keeps awake.
    peer_driver: SandboxDriver | None = None
    #: The learned idle gaps kept in the record (``meta.activity``, written as it sleeps) were read back.
    restored: bool = False
    #: The lease epoch under which this manager holds it (fleet: checked by every turn commit).
    epoch: int = 0
    #: Fleet: shipping its awake state (after turns, and every ``ship_interval_s``); when it last finished
    #: (monotonic); whether a turn ended since the pending ship started.
    ship_task: "asyncio.Task[None] | None" = None
    last_ship: float = 0.0
    ship_dirty: bool = False

    @property
    def awake(self) -> bool:
        return self.sandbox is not None and self.sandbox.state is SandboxState.RUNNING


@dataclass(frozen=True)
class ManagerStats:
    wakes: int
    provisions: int
    sleeps: int
    evictions: int


class WakeKind:
    """How an instance's sandbox came up, recorded in its record's ``meta.wake_kind`` and its lifecycle span."""

    #: A new instance restored from its template's snapshot (copy-on-write fork, no boot).
    FORK = "fork"
    #: A sleeping instance restored from its own snapshot, processes and memory included.
    SNAPSHOT = "snapshot"
    #: Booted from disk because the driver keeps no memory snapshot (the process driver).
    COLD = "cold"
    #: Booted from disk because the snapshot that should have been restored was damaged or incompatible.
    COLD_FALLBACK = "cold-fallback"


def wake_kind(sandbox: Sandbox, *, fork: bool) -> str:
    mode = getattr(sandbox, "last_wake_mode", None)
    if mode == "snapshot":
        return WakeKind.FORK if fork else WakeKind.SNAPSHOT
    if getattr(sandbox, "last_wake_fallback", None) is not None:
        return WakeKind.COLD_FALLBACK
    return WakeKind.COLD


def _restore_activity(li: LiveInstance, rec: SandboxRecord | None) -> None:
    """Give a newly seen instance the idle gaps and turn count its record kept from earlier hosts."""
    doc = (rec.meta if rec is not None else {}).get("activity")
    if not isinstance(doc, dict) or li.activity.gaps.count:
        return
    try:
        li.activity.gaps = IdleGapHistogram.from_dict(doc.get("gaps") or {})
        li.activity.turns += int(doc.get("turns") or 0)
    except (InvalidInput, TypeError, ValueError, KeyError) as e:  # an unreadable history only costs the learning
        log.warning("learned idle gaps not restored", instance=rec.id if rec else None, error=str(e))


def default_host_id() -> str:
    return socket.gethostname() or "localhost"


class InstanceManager(fleet_rules.FleetDuties):
    """Brings agent instances up on this host and puts them to sleep when the policy or capacity says so.

    ``host_id`` names this host in the store's placement; managers sharing a sandbox root share a host id.
    """

    def __init__(
        self,
        store: Store,
        driver: SandboxDriver,
        *,
        host_id: str | None = None,
        policy: SleepPolicy | None = None,
        economics: SleepEconomics | None = None,
        capacity: HostCapacity | None = None,
        claim_timeout_s: float = 120.0,
        poll_s: float = 0.05,
        tick_s: float = 0.2,
        ttl_every_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.driver = driver
        self.owner = Owner.this_process(host_id or default_host_id())
        self.default_policy: SleepPolicy = policy or FixedTimeout(300.0)
        self.economics = economics
        self.capacity = capacity or HostCapacity()
        self.claim_timeout_s = claim_timeout_s
        self.poll_s = poll_s
        self.tick_s = tick_s
        self.ttl_every_s = ttl_every_s
        self.clock = clock
        self._live: dict[tuple[str, str], LiveInstance] = {}
        self._by_record: dict[str, LiveInstance] = {}
        self._system: dict[str, TenantStore] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._counts = {"wakes": 0, "provisions": 0, "sleeps": 0, "evictions": 0}
        #: Pre-forked sleeping sandboxes per live template (set by the host; None: every new user forks).
        self.pool: WarmPool | None = None
        #: Awake instances one tenant may have on this host (set by the host; None: no limit). A tenant at its
        #: limit has its least recently active idle instance put to sleep; if all are busy: ``TenantAwakeLimit``.
        self.tenant_max_awake: int | None = None
        #: This host's fleet membership (set by the host when the store is shared; None: one host).
        self.fleet: FleetMember | None = None
        #: Fleet: an awake instance's state is shipped at most every ``SHIP_MIN_INTERVAL_S`` after turns, and at
        #: least every ``ship_interval_s`` (``checkpoint_interval_s``) while awake; False once the driver cannot.
        self.ship_interval_s = 60.0
        self._ship_awake_ok = True
        #: Fleet: bytes of sleeping instances' copies this host keeps (least recently used evicted; 0: no bound).
        self.cache_max_bytes = 0
        #: Fleet: held while a sandbox's directory is made local and woken, or evicted from this host's cache.
        self._dir_locks: dict[str, asyncio.Lock] = {}
        #: Awaited (tenant id, scope) by a requested ``sleep`` before it looks at the instance: the runtime's wait
        #: for an automatic checkpoint still being taken after a reply went out (None: nothing to wait for).
        self.settle: Callable[[str, Scope], Awaitable[None]] | None = None

    @property
    def host(self) -> str:
        return self.owner.host

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(**self._counts)

    # --- start / stop ---------------------------------------------------------------------------------------

    async def start(self, *, background: bool = True) -> "Any":
        """Recover what a previous incarnation left on this host, then start the idle and TTL loops."""
        from moorage.lifecycle.recovery import recover

        report = await recover(self)
        if self.pool is not None and background:
            self.pool.start()
        if background:
            self._tasks.append(asyncio.create_task(self._idle_loop(), name="lifecycle-idle"))
            self._tasks.append(asyncio.create_task(self._ttl_loop(), name="lifecycle-ttl"))
            if self.fleet is not None:
                self._tasks.append(asyncio.create_task(self._ship_loop(), name="fleet-ship"))
        return report

    async def close(self) -> None:
        """Stop the loops and detach from every sandbox. Instances keep running; the store says where they are."""
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for li in self._live.values():
            if li.ship_task is not None and not li.ship_task.done():
                li.ship_task.cancel()
        if self.pool is not None:
            await self.pool.close()
        for li in self._live.values():
            if li.peer_driver is not None:
                await li.peer_driver.close()
        await self.driver.close()
        self._live.clear()
        self._by_record.clear()

    # --- helpers --------------------------------------------------------------------------------------------

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking store call off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    def system_tenant(self, tenant_id: str) -> TenantStore:
        """moorage's own handle on one tenant, for background jobs (blocking on first use)."""
        ts = self._system.get(tenant_id)
        if ts is None:
            ts = self._system[tenant_id] = self.store.tenant(self.store.operator.principal(tenant_id))
        return ts

    def policy_for(self, lc: AgentLifecycle) -> SleepPolicy:
        return self.default_policy if lc.sleep is None else parse_policy(lc.sleep, self.economics)

    def _ram_of(self, sandbox: Sandbox | None) -> int:
        spec = getattr(sandbox, "spec", None)
        return int(getattr(spec, "memory_mib", 0) or self.driver.config.guest_memory_mib)

    def live(self, ts: TenantStore, scope: Scope) -> LiveInstance | None:
        return self._live.get((ts.tenant_id, scope.key))

    def _live_for(self, ts: TenantStore, scope: Scope, lc: AgentLifecycle | None) -> LiveInstance:
        key = (ts.tenant_id, scope.key)
        li = self._live.get(key)
        if li is None:
            now = self.clock()
            policy = self.policy_for(lc) if lc is not None else self.default_policy
            li = self._live[key] = LiveInstance(ts.tenant_id, scope, InstanceActivity.new(scope.key, now), policy,
                                                self.driver.config.guest_memory_mib)
        return li

    def awake_instances(self) -> list[AwakeInstance]:
        """Instances this manager keeps awake (and may evict), for host-capacity decisions."""
        return [AwakeInstance(f"{li.tenant_id}/{li.scope.key}", li.ram_mib, li.activity.in_flight, li.activity.last_active)
                for li in self._live.values() if li.owned and li.awake]

    # --- the request path -----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def turn(self, ts: TenantStore, scope: Scope, template: TemplateSource, *,
                   lifecycle: AgentLifecycle | None = None, trace: TraceContext | None = None,
                   here: bool = False) -> AsyncIterator[Sandbox]:
        """Hold one turn on the instance: it is running for the whole block and is never slept or evicted meanwhile.
        ``here``: see ``ensure_running``."""
        li = self._live_for(ts, scope, lifecycle)
        # Counted before any await, so the idle loop and LRU eviction already see the turn while it waits for a wake.
        li.activity.turn_started(self.clock())
        try:
            sandbox = await self.ensure_running(ts, scope, template, lifecycle=lifecycle, trace=trace, here=here)
            yield sandbox
        finally:
            li.activity.turn_ended(self.clock())
            if self.fleet is not None:
                self._ship_soon(li)

    async def ensure_running(self, ts: TenantStore, scope: Scope, template: TemplateSource, *,
                             lifecycle: AgentLifecycle | None = None, trace: TraceContext | None = None,
                             here: bool = False) -> Sandbox:
        """The instance's running sandbox: provisioned from ``template`` if new, woken if asleep (once, however
        many callers ask at the same time, in this process and across processes).

        ``here``: brought up on this host even while it drains (a fork that began here before the drain, whose
        template is on this disk, finishes here; the drain then sleeps and ships what it made)."""
        if self._closed:
            raise UnavailableError("the instance manager is shut down", hint="retry against a running host")
        li = self._live_for(ts, scope, lifecycle)
        if li.pending is not None:
            return await asyncio.shield(li.pending)
        if li.awake and li.owned:
            # Placement is still confirmed in the store: another host or a TTL job may have moved it meanwhile.
            rec = await self.io(ts.sandboxes.for_scope, scope)
            if rec is not None and rec.id == li.record_id and rec.state == S.RUNNING.value and li.awake:
                if rec.host == self.host and rec.lease_epoch == li.epoch:
                    return li.sandbox  # type: ignore[return-value]
                await self._lost(li, rec)  # another host took it over while we were cut off
        if li.pending is not None:  # another caller started a bring-up while we read the store
            return await asyncio.shield(li.pending)
        fut: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
        # Nobody else may be waiting; never leave an exception "not retrieved".
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        li.pending = fut
        try:
            sandbox = await self._bring_up(ts, li, template, trace or TraceContext.new(), here=here)
        except BaseException as e:
            fut.set_exception(e if isinstance(e, Exception) else UnavailableError("bring-up cancelled"))
            raise
        else:
            fut.set_result(sandbox)
            return sandbox
        finally:
            li.pending = None

    async def _bring_up(self, ts: TenantStore, li: LiveInstance, source: TemplateSource,
                        trace: TraceContext, *, here: bool = False) -> Sandbox:
        scope = li.scope
        if self.fleet is not None and self.fleet.draining and not forwarded.get() and not here:
            other = await self.io(self.fleet.elsewhere)
            if other is not None:  # draining: bring it up on another host (a forwarded request is served here)
                raise Misplaced(None, other.id)
        deadline = time.monotonic() + 2 * self.claim_timeout_s
        while True:
            if time.monotonic() > deadline:
                raise UnavailableError(f"instance of {scope} stayed in a transitional state too long",
                                       hint="retry; if it persists, check the host named in its record")
            rec = await self.io(ts.sandboxes.for_scope, scope)
            if not li.restored:
                li.restored = True
                _restore_activity(li, rec)
            if rec is None:
                template = await _resolve(source)
                if template is None:
                    raise InvalidInput(f"{scope} has no instance and no template to provision it from",
                                       hint="deploy the agent (which makes its template) before sending it requests")
                await self._tenant_room(li)
                await self._make_room(li)
                pooled = await self.pool.take(template) if self.pool is not None else None
                try:
                    rec = await self.io(machine.provision, ts, scope, owner=self.owner, template_ref=template.id,
                                        sandbox_id=pooled or uuid.uuid4().hex, trace=trace,
                                        meta={"pooled": True} if pooled else None)
                except BaseException as e:
                    if pooled:  # out of the pool already: nobody else would ever remove it
                        await self._destroy_quietly(pooled)
                    if isinstance(e, ConflictError):
                        continue  # someone else provisioned it first: follow their record
                    raise
                return await self._provision(ts, li, rec, template, trace, fresh=True, pooled=pooled is not None)
            takeover = rec.host not in (None, self.host) and not self._moved_here(rec)
            if takeover and (self.fleet is None or await self.io(fleet_rules.placement, self.fleet, rec) == "forward"):
                raise Misplaced(rec)
            previous_epoch, previous_host = rec.lease_epoch, rec.host
            state = S(rec.state)
            verb: V | None = None
            if state is S.RUNNING and takeover:
                verb = V.CLAIM_WAKE  # its host's lease lapsed: wake it here from what it last shipped
            elif state is S.RUNNING:
                sandbox = await self._attach(li, rec)
                if sandbox is not None:
                    self._adopted(li, rec, sandbox)
                    return sandbox
                verb = V.CLAIM_WAKE  # recorded running here, but its processes are gone (a host crash)
            elif state in (S.SLEEPING, S.ARCHIVED, S.FAILED):
                verb = V.CLAIM_WAKE
            elif state in (S.WAKING, S.PROVISIONING, S.SUSPENDING, S.DELETED):
                if not takeover and not machine.claim_is_dead(rec, self.owner, self.claim_timeout_s):
                    await asyncio.sleep(self.poll_s)  # the claimant will move it on; follow the record
                    continue
                if state is S.DELETED:
                    from moorage.lifecycle.ttl import finish_delete

                    await finish_delete(self, ts, rec, trace)
                    continue
                verb = V.RECLAIM
            await self._tenant_room(li)
            try:
                rec = await self.io(machine.apply, ts, rec, verb, owner=self.owner, trace=trace, host=self.host)
            except ConflictError:
                continue  # lost the claim: the winner wakes it, we follow the record
            template = await _resolve(source) if rec.state == S.PROVISIONING.value else None
            if rec.state == S.PROVISIONING.value:
                if template is None:
                    raise InvalidInput(f"{scope} must be provisioned again but no template was given")
                return await self._provision(ts, li, rec, template, trace, fresh=False)
            return await self._wake(ts, li, rec, source, trace, previous_epoch, previous_host)

    def _moved_here(self, rec: SandboxRecord) -> bool:
        """One host (no fleet) holding an asleep instance's sandbox although the record names another host id: its
        data directory was restored on another machine (docs/operations.md). The sandbox lives where its files are,
        so this host wakes it (and the wake records this host). One recorded awake stays its host's (a copy taken
        while it ran is not where it stopped); in a fleet a host id is a member, never re-homed."""
        return self.fleet is None and rec.state in (S.SLEEPING.value, S.ARCHIVED.value, S.FAILED.value) and \
            (Path(self.driver.root) / rec.id / "meta.json").exists()

    async def _attach(self, li: LiveInstance, rec: SandboxRecord) -> Sandbox | None:
        """The running sandbox the record points at, or None when its processes are gone."""
        try:
            sandbox = await self.driver.open(rec.id)
        except SandboxNotFound:
            return None
        if sandbox.state is SandboxState.RUNNING:
            return sandbox
        owner = rec.meta.get("owner")
        probe = SandboxRecord(**{**rec.__dict__, "meta": {"claim": owner}})
        if isinstance(owner, dict) and owner.get("owner") != self.owner.id and \
                not machine.claim_is_dead(probe, self.owner, float("inf")):
            # Another live process on this host woke it after we last saw it: our driver's cached handle is stale
            # (it still says sleeping). Re-adopt it through a fresh driver view of the same root.
            if li.peer_driver is not None:
                await li.peer_driver.close()
            li.peer_driver = type(self.driver)(self.driver.root, self.driver.config)
            try:
                sandbox = await li.peer_driver.open(rec.id)
            except SandboxNotFound:
                return None
            return sandbox if sandbox.state is SandboxState.RUNNING else None
        return None

    def _adopted(self, li: LiveInstance, rec: SandboxRecord, sandbox: Sandbox) -> None:
        li.record_id = rec.id
        li.sandbox = sandbox
        li.epoch = rec.lease_epoch
        self._by_record[rec.id] = li
        li.ram_mib = self._ram_of(sandbox)
        owner = rec.meta.get("owner") or {}
        li.owned = owner.get("owner") == self.owner.id

    async def _wake(self, ts: TenantStore, li: LiveInstance, rec: SandboxRecord, source: TemplateSource,
                    trace: TraceContext, previous_epoch: int | None = None,
                    previous_host: str | None = None) -> Sandbox:
        """We hold the ``waking`` claim on ``rec`` (taken from ``previous_host``): restore its sandbox and mark it
        running."""
        started = time.time()
        resumed: dict[str, Any] | None = None
        async with li.op_lock:
            try:
                await self._make_room(li)
                try:
                    async with self._dir_lock(rec.id):
                        if self.fleet is not None:
                            resumed = await self.io(self.fleet.make_local, ts.tenant_id, rec,
                                                    rec.lease_epoch if previous_epoch is None else previous_epoch)
                            if resumed["from"] == "none":
                                raise SandboxNotFound(f"no copy of instance {rec.id} on this host or in the object store")
                        sandbox = await self.driver.open(rec.id)
                except SandboxNotFound:
                    template = await _resolve(source)
                    if template is None:
                        raise
                    log.warning("instance disk is gone; provisioning it again", instance=rec.id, scope=str(li.scope))
                    rec = await self.io(machine.apply, ts, rec, V.REPROVISION, owner=self.owner, trace=trace,
                                        reason="sandbox missing on disk")
                    return await self._provision(ts, li, rec, template, trace, fresh=False, locked=True)
                if sandbox.state is SandboxState.CREATED:
                    await sandbox.start()
                elif sandbox.state is not SandboxState.RUNNING:
                    await sandbox.wake()
            except (CapacityExhausted, ConflictError):
                await self._give_up(ts, rec, trace, "no capacity to wake it")
                raise
            except Exception as e:
                await self._give_up(ts, rec, trace, f"wake failed: {e}")
                holder = await self.holder_while_store_down(e, previous_host)
                if holder is not None:  # its last host's disk may hold its copy: that host wakes it
                    raise Misplaced(None, holder) from e
                raise WakeFailed(f"could not wake the instance of {li.scope}: {e}",
                                 hint="retry; the instance is marked failed and the next request tries again") from e
            kind = wake_kind(sandbox, fork=False)
            rec = await self.io(self._mark_running, ts, rec, V.WOKE, trace, started, "wakes", kind, resumed)
            self._counts["wakes"] += 1
            self._adopted(li, rec, sandbox)
            self._log_bring_up("instance woke", rec, li, kind, started, sandbox)
            if previous_host not in (None, self.host):
                await self.taken_over(ts, li.scope, sandbox)
            return sandbox

    @staticmethod
    def _log_bring_up(what: str, rec: SandboxRecord, li: LiveInstance, kind: str, started: float, sandbox: Sandbox,
                      **extra: Any) -> None:
        ms = round((time.time() - started) * 1000, 1)
        if kind == WakeKind.COLD_FALLBACK:
            # The declared fallback: the snapshot (a fork's template, or the instance's own) could not be restored.
            log.warning(f"{what} by a cold boot: its snapshot was unusable", instance=rec.id, scope=str(li.scope),
                        ms=ms, reason=str(getattr(sandbox, "last_wake_fallback", "") or ""), **extra)
        else:
            log.info(what, instance=rec.id, scope=str(li.scope), kind=kind, ms=ms, **extra)

    def _mark_running(self, ts: TenantStore, rec: SandboxRecord, verb: V, trace: TraceContext, started: float,
                      usage: str | None, kind: str, resumed: dict[str, Any] | None = None) -> SandboxRecord:
        # ``awake_since``: compute is metered from here to the sleep (usage ``compute_seconds``, see _mark_slept).
        meta = {**rec.meta, "owner": self.owner.claim(), "wake_kind": kind, "awake_since": time.time()}
        if resumed is not None:  # fleet: which copy it resumed from (its own disk, or a shipped snapshot)
            meta["resumed_from"] = resumed
        with ts.transaction():
            new = machine.apply(ts, rec, verb, owner=self.owner, trace=trace, claim=False, host=self.host, meta=meta,
                                last_active=time.time(), started_at=started, reason=f"wake kind: {kind}")
            if usage:
                ts.usage.add(usage, 1, agent_id=rec.scope.agent, user_id=rec.scope.user, scope=rec.scope)
        return new

    def _mark_slept(self, ts: TenantStore, rec: SandboxRecord, trace: TraceContext, meta: dict[str, Any],
                    snapshot_ref: str, started: float, reason: str, sizes: dict[str, int] | None = None) -> SandboxRecord:
        """Record the sleep and, in the same transaction, the awake seconds since the instance was marked running
        (per agent and end-user, measured from state changes, not estimated)."""
        with ts.transaction():
            new = machine.apply(ts, rec, V.SLEPT, owner=self.owner, trace=trace, claim=False, meta=meta,
                                snapshot_ref=snapshot_ref, last_active=time.time(), started_at=started, reason=reason)
            since = rec.meta.get("awake_since")
            if isinstance(since, (int, float)):
                ts.usage.add("compute_seconds", max(0.0, time.time() - since), agent_id=rec.scope.agent,
                             user_id=rec.scope.user, scope=rec.scope, meta={"instance": rec.id, "reason": reason})
            usage_ledger.record(ts, rec, sizes or {})
        return new

    async def _give_up(self, ts: TenantStore, rec: SandboxRecord, trace: TraceContext, reason: str) -> None:
        """Release a claim we cannot complete, so the next request (or recovery) retries instead of waiting."""
        try:
            cur = await self.io(ts.sandboxes.get, rec.id)
            if machine.target(cur.state, V.FAIL) is not None:
                await self.io(machine.apply, ts, cur, V.FAIL, owner=self.owner, trace=trace, reason=reason[:500])
        except MoorageError as e:
            log.warning("could not mark instance failed", instance=rec.id, error=str(e))

    async def _provision(self, ts: TenantStore, li: LiveInstance, rec: SandboxRecord, template: TemplateRef,
                         trace: TraceContext, *, fresh: bool, locked: bool = False, pooled: bool = False) -> Sandbox:
        """We hold the ``provisioning`` claim on ``rec``: fork the template into its sandbox (or take the pooled
        fork ``rec`` names) and bring it up from the template's snapshot."""
        started = time.time()
        async with contextlib.AsyncExitStack() as stack:
            if not locked:
                await stack.enter_async_context(li.op_lock)
            try:
                if not fresh:
                    await self._destroy_quietly(rec.id)  # a half-made sandbox from a dead claimant
                if pooled:
                    sandbox = await self.driver.open(rec.id)
                else:
                    (sandbox,) = await self.driver.fork(template, [rec.id])
                if sandbox.state is SandboxState.CREATED:
                    await sandbox.start()  # a driver without memory snapshots: its forks boot
                else:
                    # The fork is the template's snapshot: restoring it keeps its RAM a delta of the template's
                    # and skips the boot. The driver falls back to a cold boot only if that snapshot is unusable.
                    await sandbox.wake()
            except Exception as e:
                await self._destroy_quietly(rec.id)
                await self._give_up(ts, rec, trace, f"provisioning failed: {e}")
                raise WakeFailed(f"could not provision the instance of {li.scope} from template {template.id}: {e}",
                                 hint="check the template (redeploy the agent) and retry") from e
            kind = wake_kind(sandbox, fork=True)
            # The template this sandbox is a fork of (a reprovisioned instance's is today's, not the one its row
            # was created with): the template collector keeps it while the instance lives (fleet/gc.py).
            # A fresh fork binds nothing of another template (runtime/instance_update.py).
            meta = {k: v for k, v in rec.meta.items() if k != SHARED_TEMPLATE}
            rec = SandboxRecord(**{**rec.__dict__, "meta": {**meta, FORKED_FROM: template.id}})
            if self.fleet is not None:
                await self.io(self.fleet.shipper.mark_running, self.driver.root / rec.id, rec.lease_epoch)
            rec = await self.io(self._mark_running, ts, rec, V.PROVISIONED, trace, started, None, kind)
            self._counts["provisions"] += 1
            self._adopted(li, rec, sandbox)
            self._log_bring_up("instance provisioned", rec, li, kind, started, sandbox, template=template.id)
            return sandbox

    async def _destroy_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxNotFound):
            sandbox = await self.driver.open(sandbox_id)
            await sandbox.destroy()

    # --- sleeping -------------------------------------------------------------------------------------------

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
                rec = await self.io(machine.apply, ts, rec, V.CLAIM_SLEEP, owner=self.owner, trace=trace, reason=reason)
            except ConflictError:
                return False
            if li.activity.busy:
                # A turn arrived while the claim was written: hand the instance straight back to it.
                await self.io(machine.apply, ts, rec, V.ADOPT, owner=self.owner, trace=trace, claim=False,
                              reason="turn arrived during sleep claim")
                return False
            sandbox = li.sandbox
            li.sandbox = None
            try:
                snap = await sandbox.sleep()
            except Exception as e:
                await self._give_up(ts, rec, trace, f"sleep failed: {e}")
                log.error("instance failed to sleep", instance=rec.id, error=str(e))
                return False
            meta = {k: v for k, v in rec.meta.items() if k not in ("owner", "awake_since")}
            # The habits a policy learned (idle gaps) go with the record, so a restarted host still knows them.
            meta["activity"] = {"turns": li.activity.turns, "gaps": li.activity.gaps.to_dict()}
            if self.fleet is not None:
                # Acknowledged only once durable in the object store; if shipping fails the sleep still stands
                # and this host (whose disk has the newest copy) keeps serving it.
                try:
                    meta["shipped"] = await self.io(self.fleet.ship, ts.tenant_id, rec, rec.lease_epoch)
                    meta["shipped_current"] = True
                except Exception as e:
                    meta["shipped_current"] = False
                    self._unshipped_check = True  # shipped later, once the object store is back (_ship_loop)
                    log.error("snapshot could not be shipped; it stays on this host", instance=rec.id, error=str(e))
            sizes = await usage_ledger.measure(sandbox)  # disk and snapshot bytes, metered with the sleep
            await self.io(self._mark_slept, ts, rec, trace, meta, str(snap.path), started, reason, sizes)
            li.owned = False
            self._counts["evictions" if evict else "sleeps"] += 1
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
                    raise TenantAwakeLimit(self.tenant_max_awake)
            try:
                victims = HostCapacity(max_awake=here).victims(mine, incoming=1)
            except CapacityExhausted as e:
                raise TenantAwakeLimit(self.tenant_max_awake) from e
            if not victims:
                return
            by_id = {f"{x.tenant_id}/{x.scope.key}": x for x in self._live.values()}
            for v in victims:
                await self._sleep(by_id[v], "tenant's awake limit: least recently active", evict=True)
        raise TenantAwakeLimit(self.tenant_max_awake)

    async def tick(self) -> int:
        """One pass of the sleep policy over every idle instance this manager owns; returns how many slept."""
        slept = 0
        for li in list(self._live.values()):
            if not li.owned or li.sandbox is None or li.activity.busy:
                continue
            decision = li.policy.decide(li.activity, self.clock())
            if decision.sleep_now:
                try:
                    slept += await self._sleep(li, decision.reason)
                except MoorageError as e:
                    log.warning("idle sleep failed", scope=str(li.scope), error=str(e))
        return slept

    async def _idle_loop(self) -> None:
        while not self._closed:
            try:
                await self.tick()
            except Exception as e:  # the loop must outlive one bad instance
                log.error("idle loop pass failed", error=str(e))
            await asyncio.sleep(self.tick_s)

    async def _ttl_loop(self) -> None:
        from moorage.lifecycle.ttl import sweep

        while not self._closed:
            await asyncio.sleep(self.ttl_every_s)
            try:
                await sweep(self)
            except Exception as e:
                log.error("ttl sweep failed", error=str(e))

    def forget(self, tenant_id: str, scope: Scope) -> None:
        """Drop the in-process entry of an instance that was deleted."""
        li = self._live.get((tenant_id, scope.key))
        if li is not None and not li.activity.busy and li.pending is None:
            del self._live[(tenant_id, scope.key)]
            if li.record_id is not None:
                self._by_record.pop(li.record_id, None)

