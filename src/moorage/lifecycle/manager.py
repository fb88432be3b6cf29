"""The instance manager, one per host process: provisions, wakes (single-flight), sleeps idle instances, evicts LRU.

The store is the source of truth for every instance's state and placement; process memory only caches open
sandboxes and tracks turns in flight (so an instance mid-turn is never slept or evicted). The request path lives in
bring_up.py, the sleep path in sleeping.py, the fleet's part in fleet.py; this module binds them to one host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle.bring_up import BringUp
from moorage.lifecycle.capacity import AwakeInstance, HostCapacity
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.errors import Misplaced, TenantAwakeLimit, WakeFailed
from moorage.lifecycle.instance import LiveInstance, ManagerStats, TemplateSource, WakeKind, wake_kind
from moorage.lifecycle.machine import Owner
from moorage.lifecycle.new_instances import NewInstances
from moorage.lifecycle.policies import FixedTimeout, InstanceActivity, SleepEconomics, SleepPolicy, parse_policy
from moorage.lifecycle.pool import WarmPool
from moorage.lifecycle.sleeping import Sleeping
from moorage.log import FailingRounds, get_logger
from moorage.sandbox import Sandbox, SandboxDriver
from moorage.store import Scope, Store, TenantStore

if TYPE_CHECKING:
    from moorage.fleet.member import FleetMember

#: Named here for importers (the API, the runtime, tests): they live in errors.py and instance.py.
__all__ = ["InstanceManager", "LiveInstance", "ManagerStats", "Misplaced", "TemplateSource", "TenantAwakeLimit",
           "WakeFailed", "WakeKind", "default_host_id", "wake_kind"]

T = TypeVar("T")


def default_host_id() -> str:
    return socket.gethostname() or "localhost"


class InstanceManager(BringUp, Sleeping, fleet_rules.FleetDuties):
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
        #: Outcomes being recorded in the background once the store can take them (``_record_later``).
        self._recording: set[asyncio.Task[None]] = set()
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
        #: Idle sleeps refused because the store (or the object store) is out of reach: one line per round and per
        #: minute, not one per instance per round (``tick``).
        self._idle_unreachable = FailingRounds(get_logger("moorage.lifecycle.manager"), "idle sleep",
                                               level=logging.WARNING)
        self._awake_ship_rounds = FailingRounds(get_logger("moorage.lifecycle.manager"), "shipping an awake instance",
                                                level=logging.WARNING)
        self._unshipped_rounds = FailingRounds(get_logger("moorage.lifecycle.manager"), "shipping sleeping instances",
                                               level=logging.WARNING)
        #: Pre-forked sleeping sandboxes per live template (set by the host; None: every new user forks).
        self.pool: WarmPool | None = None
        #: Awake instances one tenant may have on this host (set by the host; None: no limit). A tenant at its
        #: limit has its least recently active idle instance put to sleep; if all are busy: ``TenantAwakeLimit``.
        self.tenant_max_awake: int | None = None
        #: Called before a new instance's record is made (set by the host; None: none): raises to refuse it (the
        #: tenant past its storage ceiling, usage/tenant_cap.py).
        self.admit_new_instance: Callable[[TenantStore], Awaitable[None]] | None = None
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
        #: Told the record id of an instance this process no longer holds (deleted, or released after a long
        #: sleep): what others keep per sandbox goes too.
        self.forgotten: Callable[[str], None] | None = None
        #: An instance asleep and untouched this long is released from this process's memory (``release_asleep``).
        self.release_after_s = 600.0
        #: The instance records being created, per tenant; an online backup holds new ones back while it lists a
        #: tenant's instances the last time and copies its store (runtime/backup.py).
        self.new_instances = NewInstances()

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
        recording = list(self._recording)  # outcomes waiting for the store: the record's claim lapses instead
        for t in [*self._tasks, *recording]:
            t.cancel()
        for t in [*self._tasks, *recording]:
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

    def forget(self, tenant_id: str, scope: Scope) -> None:
        """Drop the in-process entry of an instance that was deleted."""
        li = self._live.get((tenant_id, scope.key))
        if li is not None and not li.activity.busy and li.pending is None:
            self._drop(li)

    def _record_later(self, name: str, attempt: Callable[[], Awaitable[None]],
                      again: Callable[[Exception], bool]) -> None:
        """An outcome the store could not take now (unreachable, or its disk full): ``attempt`` runs in the
        background every second while the record's claim lives, until it returns, or raises what ``again`` does
        not retry; past the claim (or at ``close``) the claim lapses instead. So an instance is not left claimed,
        with every request for it waiting, until the claim times out."""
        async def run() -> None:
            deadline = time.monotonic() + self.claim_timeout_s
            while not self._closed and time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                try:
                    await attempt()
                except Exception as e:
                    if again(e):
                        continue
                    raise
                return

        task = asyncio.get_running_loop().create_task(run(), name=name)
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    def _drop(self, li: LiveInstance) -> None:
        del self._live[(li.tenant_id, li.scope.key)]
        if li.record_id is not None:
            self._by_record.pop(li.record_id, None)
            self._dir_locks.pop(li.record_id, None)
            if self.forgotten is not None:
                self.forgotten(li.record_id)
