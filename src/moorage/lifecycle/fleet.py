"""The instance manager's part in a fleet: serve here, forward to the owner, or take the instance over; leases,
shipping awake instances, and the bounded cache of sleeping ones.

Kept apart from the manager so the one-host path reads without them; the manager uses these only when the host
is a fleet member (``manager.fleet`` set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable

from moorage.errors import ConflictError, NotFound, UnavailableError
from moorage.fleet.forward import forwarded
from moorage.fleet.member import NotPublished
from moorage.lifecycle.machine import InstanceState as S
from moorage.log import FailingRounds, get_logger
from moorage.objects import ObjectStoreUnavailable
from moorage.sandbox.process_fs import proc_starttime
from moorage.sandbox import SandboxError
from moorage.store import SandboxRecord, Scope
from moorage.store.repos.sandboxes import LeaseLost  # noqa: F401 - raised by turn commits; named here for callers

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember
    from moorage.lifecycle.manager import LiveInstance

log = get_logger("moorage.lifecycle.manager")

#: The least time between two shipments of one awake instance (turns in between are coalesced).
SHIP_MIN_INTERVAL_S = 2.0

#: Every this many passes of the ship loop (5 min by default), copies of instances gone from the store are removed.
FORGOTTEN_EVERY = 5

#: States in which the record's host holds the instance (awake, or moving it); others may take it only if that
#: host's lease lapsed.
HELD = frozenset({S.RUNNING.value, S.WAKING.value, S.SUSPENDING.value, S.PROVISIONING.value, S.DELETED.value})


class HostDraining(UnavailableError):
    """This host is draining: it starts no new work that would leave new instances on it (a fork). Raised before
    anything is written; a retry (the SDK's, after ``Retry-After``) lands on a live host."""

    code = "host-draining"

    def __init__(self, what: str) -> None:
        super().__init__(f"this host is draining and starts no new {what}", hint="retry: another host serves it")
        self.retry_after = 1.0


def shipped_current(rec: SandboxRecord) -> bool:
    """Whether the record's last sleep was shipped, so any host can wake it exactly where it stopped."""
    return bool(rec.meta.get("shipped_current")) and isinstance(rec.meta.get("shipped"), dict)


def placement(fleet: "FleetMember", rec: SandboxRecord) -> str:
    """For a record placed on another host: ``forward`` (its owner serves it) or ``claim`` (we take it). Blocking."""
    owner = fleet.host(rec.host) if rec.host else None
    alive = owner is not None and fleet.alive(owner)
    if rec.state in HELD:
        return "forward" if alive else "claim"
    # Asleep (or failed): anyone may wake it from the object store when its last sleep was shipped; otherwise its
    # newest copy is on its host's disk, so that host serves it while it lives.
    if shipped_current(rec) or not alive:
        return "claim"
    return "forward"


def disk_holder(fleet: "FleetMember", rec: SandboxRecord) -> str | None:
    """The live host other than this one whose disk holds the instance's newest copy (the one its record names),
    or None when that is this host or a dead one. A read of the instance's disk (its checkpoints' sandbox halves)
    is answered there: another host's copy, if any, may be an older one. Blocking."""
    if rec.host in (None, fleet.host_id):
        return None
    owner = fleet.host(rec.host)
    return rec.host if owner is not None and fleet.alive(owner) else None


class FleetDuties:
    """The fleet half of ``InstanceManager`` (a mixin: it uses the manager's state, listed below)."""

    fleet: "FleetMember | None"
    host: str
    driver: Any
    ship_interval_s: float
    cache_max_bytes: int
    _live: dict[tuple[str, str], "LiveInstance"]
    _by_record: dict[str, "LiveInstance"]
    _dir_locks: dict[str, asyncio.Lock]
    _ship_awake_ok: bool
    #: Shipments refused while the object store is out of reach, said once and then once a minute, not once per
    #: instance and pass (``moorage.log.FailingRounds``; made by the manager).
    _awake_ship_rounds: FailingRounds
    _unshipped_rounds: FailingRounds
    _closed: bool
    store: Any
    #: Whether this host may hold sleeping instances whose sleep was not shipped (the object store was down):
    #: set at start and by such a sleep (``note_unshipped``), cleared once a pass of ``ship_unshipped`` found none
    #: left and no such sleep was recorded while it ran.
    _unshipped_check: bool = True
    #: Counts such sleeps, so a pass that read the store before one was recorded does not clear the flag it set.
    _unshipped_sleeps: int = 0
    io: Callable[..., Any]
    system_tenant: Callable[[str], Any]

    #: Awaited with (tenant store, scope, sandbox) once an instance another host held woke here, before any turn
    #: of it runs: time travel finishes an operation its old host died in the middle of (None: nothing to do).
    on_takeover: Callable[[Any, Scope, Any], Any] | None = None

    async def taken_over(self, ts: Any, scope: Scope, sandbox: Any) -> None:
        if self.on_takeover is None:
            return
        try:
            await self.on_takeover(ts, scope, sandbox)
        except Exception as e:  # noqa: BLE001 - the instance still serves; the next time-travel call tries again
            log.error("could not finish what the instance's previous host left half done", scope=str(scope),
                      error=str(e))

    async def holder_while_store_down(self, error: BaseException, host: str | None) -> str | None:
        """A wake here failed because the object store cannot be reached: the live host that last held the
        instance (``host``), whose disk may still have its copy, to serve the request instead; None when there is
        none, or the request was already forwarded here (one hop)."""
        if self.fleet is None or host in (None, self.host) or forwarded.get() or \
                not isinstance(error, ObjectStoreUnavailable):
            return None
        info = await self.io(self.fleet.host, host)
        return host if info is not None and self.fleet.alive(info) else None

    def claim_mark(self) -> dict[str, Any]:
        """Who holds a claim made now (an HTTP Idempotency-Key's): this manager's process, and in a fleet this host's
        incarnation, so another process can tell when the holder died (``claim_abandoned``)."""
        mark = self.owner.claim()
        if self.fleet is not None:
            mark["incarnation"] = self.fleet.incarnation
        return mark

    def claim_abandoned(self, mark: Any) -> bool:
        """Whether the holder of a claim marked ``mark`` can no longer finish it: its process on this host is gone
        (a crash, a restart), or its host is dead or started again since. A claim without a mark (made by an older
        version) is never taken for abandoned. Blocking (a fleet reads the host's row)."""
        if not isinstance(mark, dict) or not isinstance(mark.get("host"), str):
            return False
        if mark["host"] == self.owner.host:
            if mark.get("owner") == self.owner.id:
                return False  # this process's own request, still running
            pid = mark.get("pid")
            return not isinstance(pid, int) or proc_starttime(pid) != mark.get("pid_start")
        if self.fleet is None:
            return True  # another host's claim in a store only this host uses now (a moved data directory)
        info = self.fleet.host(mark["host"])
        return info is None or not self.fleet.alive(info) or info.incarnation != mark.get("incarnation")

    def refuse_if_draining(self, what: str) -> None:
        """Before work that writes first and then brings new instances up here (a fork): refused while this host
        drains, unless another host forwarded the request here (its source instance is held here). Once begun, such
        work finishes here even if the drain starts meanwhile (``ensure_running(here=True)``)."""
        if self.fleet is not None and self.fleet.draining and not forwarded.get():
            raise HostDraining(what)

    @staticmethod
    def record_now(ts: Any, record_id: str) -> Callable[[], SandboxRecord | None]:
        """Reads the instance's record as it is now, None once it is gone (blocking): a shipment is published only
        while it still names this host at the epoch it was shipped under (``FleetMember.ship``)."""
        def read() -> SandboxRecord | None:
            try:
                return ts.sandboxes.get(record_id)
            except NotFound:
                return None
        return read

    def lease(self, sandbox_id: str) -> tuple[str, int] | None:
        """(host, epoch) a turn commit must find on the record of the instance whose sandbox is ``sandbox_id``
        (fleet only; None: no check)."""
        if self.fleet is None:
            return None
        li = self._by_record.get(sandbox_id)
        return None if li is None else (self.host, li.epoch)

    async def _lost(self, li: LiveInstance, rec: SandboxRecord | None) -> None:
        """Another host owns the instance now: stop our copy of it (never two awake), forget we held it."""
        sandbox, li.sandbox, li.owned = li.sandbox, None, False
        log.warning("instance was taken over by another host; stopping this host's copy", scope=str(li.scope),
                    now_on=rec.host if rec else None, epoch=rec.lease_epoch if rec else None)
        if sandbox is not None:
            try:
                await sandbox.stop()
            except Exception as e:
                log.error("could not stop a lost instance", scope=str(li.scope), error=str(e))

    async def verify_leases(self) -> int:
        """After this host was cut off longer than its lease: stop every instance another host took meanwhile."""
        lost = 0
        for li in list(self._live.values()):
            if not li.owned or li.record_id is None:
                continue
            ts = await self.io(self.system_tenant, li.tenant_id)
            try:
                rec = await self.io(ts.sandboxes.get, li.record_id)
            except NotFound:
                rec = None
            if rec is None or rec.host != self.host or rec.lease_epoch != li.epoch:
                async with li.op_lock:
                    await self._lost(li, rec)
                lost += 1
        return lost

    def _ship_soon(self, li: LiveInstance) -> None:
        """A turn ended (or the interval passed): ship the instance's awake state soon, coalescing turns."""
        if not self._ship_awake_ok or not li.owned or li.sandbox is None or self._closed:
            return
        if li.ship_task is not None and not li.ship_task.done():
            li.ship_dirty = True  # the pending ship goes round once more
            return
        li.ship_task = asyncio.create_task(self._ship_awake(li), name=f"ship-{li.scope.key}")

    async def _ship_awake(self, li: LiveInstance) -> None:
        """Ship the awake instance's directory, frozen for the copy, so a host crash loses at most what came after
        (the record's ``meta.shipped``; ``shipped_current`` stays false: the instance runs on)."""
        assert self.fleet is not None
        while True:
            await asyncio.sleep(max(0.0, li.last_ship + SHIP_MIN_INTERVAL_S - time.monotonic()))
            for _ in range(200):  # between turns when it can: a freeze stalls a turn for the copy's duration
                if not li.activity.busy:
                    break
                await asyncio.sleep(0.05)
            li.ship_dirty = False
            try:
                async with li.op_lock:
                    if not li.owned or li.sandbox is None or li.record_id is None or self._closed:
                        return
                    ts = await self.io(self.system_tenant, li.tenant_id)
                    rec = await self.io(ts.sandboxes.get, li.record_id)
                    if rec.state != S.RUNNING.value or rec.host != self.host or rec.lease_epoch != li.epoch:
                        return
                    began = self._awake_ship_rounds.clock()
                    async with li.sandbox.frozen():
                        shipped = await self.io(self.fleet.ship, ts.tenant_id, rec, rec.lease_epoch,
                                                held=self.record_now(ts, rec.id))
                        # It runs on: the directory is no longer exactly that snapshot. Else a sleep whose shipment
                        # fails would leave it looking like one, and the cache would evict the only newest copy.
                        await self.io(self.fleet.shipper.mark_running, self.driver.root / rec.id, rec.lease_epoch)
                    li.last_ship = time.monotonic()
                    self._awake_ship_rounds.ok(began)
                    with contextlib.suppress(ConflictError):  # it moved meanwhile (a sleep ships it anyway)
                        await self.io(ts.sandboxes.update, rec.id, expected_version=rec.version,
                                      meta={**rec.meta, "shipped": {**shipped, "awake": True}, "shipped_current": False})
            except NotPublished as e:  # taken over, or forgotten, while it was copied: no longer ours to ship
                log.info("an awake instance's snapshot was not published", scope=str(li.scope), why=e.why)
                return
            except SandboxError as e:
                self._ship_awake_ok = False
                log.info("awake instances are shipped only when they sleep with this driver", reason=str(e))
                return
            except Exception as e:  # the object store is down, say: the sleep ships it, or the next turn tries again
                self._awake_ship_rounds.failed(e, scope=str(li.scope))
                li.last_ship = time.monotonic()
                return
            if not li.ship_dirty:
                return

    def note_unshipped(self) -> None:
        """A sleep could not be shipped: the ship loop looks for it again. Said before the sleep is recorded and
        again once it is, so a pass that listed the records in between keeps looking."""
        self._unshipped_sleeps += 1
        self._unshipped_check = True

    async def ship_unshipped(self) -> tuple[int, int]:
        """Ship this host's sleeping instances whose sleep could not be shipped (the object store was down), so
        any host can wake them again and the newest copy no longer depends on this host's disk. Returns
        (shipped, still unshipped)."""
        if self.fleet is None:
            return 0, 0

        def mine() -> list[tuple[str, SandboxRecord]]:
            return [(t.id, r) for t in self.store.operator.list_tenants()
                    for r in self.system_tenant(t.id).sandboxes.list(states=[S.SLEEPING.value], host=self.host,
                                                                     limit=100_000)
                    if not shipped_current(r)]

        sleeps_before = self._unshipped_sleeps
        shipped = left = tried = 0
        refused: list[str] = []
        error: Exception | None = None
        for tenant_id, rec in await self.io(mine):
            li = self._by_record.get(rec.id)
            if li is not None and (li.awake or li.pending is not None):
                continue
            # Under the directory's lock: a wake claimed meanwhile waits for the copy before it starts the sandbox.
            async with self._dir_lock(rec.id):
                ts = await self.io(self.system_tenant, tenant_id)
                try:
                    cur = await self.io(ts.sandboxes.get, rec.id)
                except NotFound:
                    continue  # forgotten meanwhile
                if cur.state != S.SLEEPING.value or cur.host != self.host or shipped_current(cur):
                    continue
                _, epoch = await self.io(self.fleet.shipper.local_state, self.driver.root / cur.id)
                if epoch is None:
                    continue  # no copy here (nothing to ship; it wakes from what it last shipped)
                tried += 1
                try:
                    meta = await self.io(self.fleet.ship, tenant_id, cur, cur.lease_epoch,
                                         held=self.record_now(ts, cur.id))
                except NotPublished as e:  # forgotten (or taken) alongside the copy: nothing left to ship
                    log.info("a sleeping instance's snapshot was not published", instance=cur.id, why=e.why)
                    continue
                except Exception as e:  # noqa: BLE001 - still down: the next pass tries again
                    left += 1
                    refused.append(cur.id)
                    error = e
                    continue
                with contextlib.suppress(ConflictError):  # woken meanwhile: its next sleep ships it
                    await self.io(ts.sandboxes.update, cur.id, expected_version=cur.version,
                                  meta={**cur.meta, "shipped": meta, "shipped_current": True})
                shipped += 1
        if error is not None:  # one line for the pass (and one a minute while it lasts), not one per instance
            self._unshipped_rounds.failed(error, still_unshipped=left, instances=refused[:10])
        elif tried:  # a pass that had nothing to ship says nothing of the object store
            self._unshipped_rounds.ok()
        if shipped:
            log.info("sleeping instances shipped after the object store came back", count=shipped, left=left)
        self._unshipped_check = left > 0 or self._unshipped_sleeps != sleeps_before
        return shipped, left

    async def _ship_loop(self) -> None:
        """At least every ``ship_interval_s``, ship awake instances not shipped since (a process may write
        between turns) and sleeping ones whose sleep could not be shipped, and keep this host's copies of
        sleeping instances within ``cache_max_bytes``."""
        passes = 0
        eviction = FailingRounds(log, "cache eviction", level=logging.WARNING)
        dropping = FailingRounds(log, "removing copies of forgotten instances", level=logging.WARNING)
        while not self._closed:
            await asyncio.sleep(self.ship_interval_s)
            now = time.monotonic()
            for li in list(self._live.values()):
                if li.owned and li.awake and now - li.last_ship >= self.ship_interval_s:
                    self._ship_soon(li)
            if self._unshipped_check:
                try:
                    await self.ship_unshipped()  # says itself how its pass went
                except Exception as e:
                    self._unshipped_rounds.failed(e)
            try:
                await self.evict_cache()
                eviction.ok()
            except Exception as e:
                eviction.failed(e)
            passes += 1
            if passes % FORGOTTEN_EVERY == 0:
                try:
                    await self.drop_forgotten()
                    dropping.ok()
                except Exception as e:
                    dropping.failed(e)

    async def drop_forgotten(self) -> int:
        """Remove this host's copies of instances that no longer exist: a user forgotten (or deleted by its TTL)
        through another host leaves the copies on every host it was on; its objects left the store, its bytes must
        leave the disks too (checkpoints included). One listing of record ids per tenant."""
        if self.fleet is None:
            return 0
        copies = await self.io(self.fleet.copies)
        if not copies:
            return 0

        def alive() -> set[str]:
            return {r.id for t in self.store.operator.list_tenants()
                    for r in self.system_tenant(t.id).sandboxes.list(limit=1_000_000)}

        live = await self.io(alive)
        removed = 0
        for sid, _tenant in copies:
            li = self._by_record.get(sid)
            if sid in live or (li is not None and (li.awake or li.pending is not None)):
                continue
            async with self._dir_lock(sid):
                self.driver.forget_handle(sid)
                await self.io(shutil.rmtree, self.driver.root / sid, True)
            self._dir_locks.pop(sid, None)
            removed += 1
        if removed:
            log.info("removed this host's copies of instances forgotten through other hosts", count=removed)
        return removed

    def _dir_lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._dir_locks.setdefault(sandbox_id, asyncio.Lock())

    async def evict_cache(self) -> int:
        """Remove this host's copies of sleeping instances, least recently used first, while they exceed
        ``cache_max_bytes``. Only copies that are exactly a shipped snapshot go (``make_local`` marks a copy as
        changed before it wakes): the object store has them, and the next wake here fetches what it needs."""
        if self.fleet is None or not self.cache_max_bytes:
            return 0
        copies = await self.io(self.fleet.evictable)
        total = sum(size for _, _, size in copies)
        removed = 0
        for _, sid, size in copies:
            if total <= self.cache_max_bytes:
                break
            li = self._by_record.get(sid)
            if li is not None and (li.awake or li.pending is not None):
                continue
            async with self._dir_lock(sid):
                key, _ = await self.io(self.fleet.shipper.local_state, self.driver.root / sid)
                if key is None:
                    continue  # woken meanwhile
                self.driver.forget_handle(sid)
                await self.io(shutil.rmtree, self.driver.root / sid, True)
            self._dir_locks.pop(sid, None)
            total -= size
            removed += 1
        if removed:
            log.info("evicted sleeping instances' copies from this host's cache", count=removed, bytes_left=total)
        return removed

    def _awake_elsewhere(self, tenant_id: str, scope: Scope) -> int:
        """The tenant's instances awake (or coming up) on other hosts of the fleet, other than ``scope``'s."""
        ts = self.system_tenant(tenant_id)
        rows = ts.read("SELECT COUNT(*) FROM sandboxes WHERE state IN ('running', 'waking', 'provisioning') "
                       "AND host IS NOT NULL AND host != ? AND scope != ?", (self.host, scope.key))
        return int(rows[0][0]) if rows else 0

