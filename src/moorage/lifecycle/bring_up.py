"""The instance manager's request path: hold a turn, and bring an instance up (provision it from its template, wake
it from its snapshot, or attach to its running sandbox), once however many callers ask at the same time."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from moorage.errors import ConflictError, InvalidInput, MoorageError, StoreUnreachable, UnavailableError
from moorage.fleet.forward import forwarded
from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle import machine
from moorage.lifecycle.capacity import CapacityExhausted
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.errors import Misplaced, WakeFailed
from moorage.lifecycle.instance import (LiveInstance, TemplateSource, WakeKind, resolve_template, restore_activity,
                                        wake_kind)
from moorage.lifecycle.machine import InstanceState as S
from moorage.lifecycle.machine import Owner, TraceContext
from moorage.lifecycle.machine import Verb as V
from moorage.lifecycle.new_instances import NewInstances
from moorage.lifecycle.pool import WarmPool
from moorage.lifecycle.sleeping import failed_outcome
from moorage.log import get_logger
from moorage.observability import events
from moorage.sandbox import Sandbox, SandboxDriver, SandboxNotFound, SandboxState, TemplateRef
from moorage.store import FORKED_FROM, SHARED_TEMPLATE, SandboxRecord, Scope, TenantStore

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember

log = get_logger("moorage.lifecycle.manager")


class BringUp:
    """The request path of ``InstanceManager`` (a mixin: the manager holds the state named below)."""

    driver: SandboxDriver
    owner: Owner
    host: str
    fleet: "FleetMember | None"
    pool: WarmPool | None
    claim_timeout_s: float
    _record_later: Callable[..., None]
    poll_s: float
    clock: Callable[[], float]
    _closed: bool
    _counts: dict[str, int]
    new_instances: NewInstances
    _by_record: dict[str, LiveInstance]
    io: Callable[..., Any]
    _live_for: Callable[..., LiveInstance]
    _ram_of: Callable[[Sandbox | None], int]
    _tenant_room: Callable[[LiveInstance], Any]
    admit_new_instance: Callable[[TenantStore], Awaitable[None]] | None
    _make_room: Callable[[LiveInstance], Any]
    _lost: Callable[..., Any]
    _ship_soon: Callable[[LiveInstance], None]
    _dir_lock: Callable[[str], asyncio.Lock]
    holder_while_store_down: Callable[..., Any]
    taken_over: Callable[..., Any]

    @contextlib.asynccontextmanager
    async def turn(self, ts: TenantStore, scope: Scope, template: TemplateSource, *,
                   lifecycle: AgentLifecycle | None = None, trace: TraceContext | None = None,
                   here: bool = False) -> AsyncIterator[Sandbox]:
        """Hold one turn on the instance: it is running for the whole block and is never slept or evicted meanwhile.
        ``here``: see ``ensure_running``."""
        li = self._live_for(ts, scope, lifecycle)
        while li.gate is not None:  # an online backup is copying it: its turns in flight end, new ones wait
            await asyncio.shield(li.gate)
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
                restore_activity(li, rec, self.owner.id)
            if rec is None:
                template = await resolve_template(source)
                if template is None:
                    raise InvalidInput(f"{scope} has no instance and no template to provision it from",
                                       hint="deploy the agent (which makes its template) before sending it requests")
                if self.admit_new_instance is not None:
                    await self.admit_new_instance(ts)
                await self._tenant_room(li)
                await self._make_room(li)
                pooled = await self.pool.take(template) if self.pool is not None else None
                try:
                    async with self.new_instances.making(ts.tenant_id):  # waits while an online backup holds them
                        rec = await self.io(machine.provision, ts, scope, owner=self.owner, template_ref=template.id,
                                            sandbox_id=pooled or uuid.uuid4().hex, trace=trace,
                                            meta={"pooled": True} if pooled else None)
                except BaseException as e:
                    if pooled:  # out of the pool already: nobody else would ever remove it
                        await self._destroy_quietly(pooled)
                        self.pool.handed(pooled)  # type: ignore[union-attr]
                    if isinstance(e, ConflictError):
                        continue  # someone else provisioned it first: follow their record
                    raise
                if pooled:  # the row names it now: a crash from here is a dead claimant's provisioning
                    self.pool.handed(pooled)  # type: ignore[union-attr]
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
            template = await resolve_template(source) if rec.state == S.PROVISIONING.value else None
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
                    template = await resolve_template(source)
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
                events.lifecycle("wake", "no-capacity", started)
                await self._give_up(ts, rec, trace, "no capacity to wake it")
                raise
            except Exception as e:
                events.lifecycle("wake", failed_outcome(e), started)
                await self._give_up(ts, rec, trace, f"wake failed: {e}")
                holder = await self.holder_while_store_down(e, previous_host)
                if holder is not None:  # its last host's disk may hold its copy: that host wakes it
                    raise Misplaced(None, holder) from e
                raise WakeFailed(f"could not wake the instance of {li.scope}: {e}",
                                 hint="retry; the instance is marked failed and the next request tries again") from e
            kind = wake_kind(sandbox, fork=False)
            try:
                rec = await self._record_running(ts, li, rec, sandbox, V.WOKE, trace, started, "wakes", kind, resumed,
                                                 taken_from=previous_host)
            except Exception as e:  # the sandbox woke, but the store did not take its record: counted too
                events.lifecycle("wake", failed_outcome(e), started, kind)
                raise
            self._counts["wakes"] += 1
            events.lifecycle("wake", "ok", started, kind)
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

    async def _record_running(self, ts: TenantStore, li: LiveInstance, rec: SandboxRecord, sandbox: Sandbox,
                              *marked: Any, taken_from: str | None = None) -> SandboxRecord:
        """``_mark_running``. When the store cannot be reached the sandbox is up but not recorded: the caller fails,
        and the record is written (and the sandbox adopted) once the store answers, tried every second while the
        claim lives, so the instance is not left claimed (every request for it waiting) until the claim times out.
        ``taken_from``: the host it was woken from (a takeover), whose half-done time travel is finished then too."""
        try:
            return await self.io(self._mark_running, ts, rec, *marked)
        except StoreUnreachable:
            self._adopt_when_back(ts, li, rec, sandbox, marked, taken_from)
            raise

    def _adopt_when_back(self, ts: TenantStore, li: LiveInstance, rec: SandboxRecord, sandbox: Sandbox,
                         marked: tuple[Any, ...], taken_from: str | None) -> None:
        async def record() -> None:
            try:
                new = await self.io(self._mark_running, ts, rec, *marked)
            except ConflictError:  # written after all (the reply was lost), or reclaimed once the claim lapsed
                new = await self.io(ts.sandboxes.get, rec.id)
                if new.state != S.RUNNING.value or (new.meta.get("owner") or {}).get("owner") != self.owner.id:
                    log.warning("instance moved on while its bring-up was recorded: stopped here", instance=rec.id)
                    with contextlib.suppress(Exception):
                        await sandbox.stop()
                    return
            if taken_from in (None, self.host):
                self._adopted(li, new, sandbox)
            else:
                await self._adopt_after_takeover(ts, li, new, sandbox)
            log.info("instance up (recorded once the store was back)", instance=rec.id, scope=str(li.scope))

        self._record_later(f"record-running-{rec.id}", record, lambda e: isinstance(e, StoreUnreachable))

    async def _adopt_after_takeover(self, ts: TenantStore, li: LiveInstance, rec: SandboxRecord,
                                    sandbox: Sandbox) -> None:
        """A takeover wake recorded late: finish what its previous host left half done (time travel), then adopt it,
        as the wake itself would have. Requests arriving meanwhile wait for it as for a bring-up in progress, so no
        turn runs on the instance before."""
        fut: asyncio.Future[Sandbox] | None = None
        if li.pending is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            li.pending = fut
        try:
            await self.taken_over(ts, li.scope, sandbox)
            self._adopted(li, rec, sandbox)
            if fut is not None:
                fut.set_result(sandbox)
        finally:
            if fut is not None:
                if not fut.done():
                    fut.set_exception(UnavailableError("the instance's bring-up was cut short",
                                                       hint="retry; the next request wakes it again"))
                li.pending = None

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
                events.lifecycle("fork", "failed", started)
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
            rec = await self._record_running(ts, li, rec, sandbox, V.PROVISIONED, trace, started, None, kind)
            self._counts["provisions"] += 1
            events.lifecycle("fork", "ok", started, kind)
            self._adopted(li, rec, sandbox)
            self._log_bring_up("instance provisioned", rec, li, kind, started, sandbox, template=template.id)
            return sandbox

    async def _destroy_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxNotFound):
            sandbox = await self.driver.open(sandbox_id)
            await sandbox.destroy()
