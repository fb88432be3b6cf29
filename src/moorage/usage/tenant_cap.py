"""A tenant's storage ceiling: how much one tenant may keep on the operator's disks, over all its agents and
end-users (``store_mib`` bounds one user; with ``users = "auto"`` a tenant could spread over many). The operator's
``tenant_max_storage_mib`` applies to every tenant but those given their own (``moorage store tenant-limits``,
kept with the tenant in the control plane and read by each host at most every ``LIMITS_EVERY_S``).

What counts (``measure``): the tenant's store (``ts.footprint.tenant_bytes``: on SQLite its file's pages in use, on
PostgreSQL its rows), its instances' disk, snapshot and checkpoint bytes at their last sleep (the usage ledger's
levels, fleet-wide; a deleted instance counts 0) and its deploy packages (each once, until every deployment naming
it is deleted). Not counted: what an instance awake now wrote or checkpointed since it woke (its ``disk_mib``
bounds it), templates.

Past the ceiling, what would keep more is refused with ``TenantStorageExceeded`` (507, code
``tenant-storage-exceeded``): an agent's calls that hand the store something to keep (a host error of that kind
in the guest), a new instance (a new user's or session's first turn, a fork into new users), and the tenant's own
API writes of content (a fact, a checkpoint taken), a deploy of a new package. Turns of existing instances still run
and read; deleting end-users or deployments, retention and rollbacks free room.

Measuring PostgreSQL reads every row of the tenant, so each host process keeps one measure per tenant and adds
what the calls it admits hand the store. A measure older than ``MEASURE_EVERY_S`` is taken again in the
background (the old one answers meanwhile); one older than ``RECHECK_S`` is taken again, and waited for, when a
write would cross the ceiling, so room freed anywhere in the fleet counts within seconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moorage.errors import MoorageError
from moorage.log import get_logger
from moorage.usage import ledger

if TYPE_CHECKING:
    from moorage.store import TenantStore

log = get_logger(__name__)

MIB = 1 << 20
#: A measure older than this is taken again in the background at the tenant's next write.
MEASURE_EVERY_S = 60.0
#: A write that would cross the ceiling measures again (and waits for it) when the measure is older than this.
RECHECK_S = 10.0
#: A tenant's own ceiling (``moorage store tenant-limits``) is read again at its first write after this long.
LIMITS_EVERY_S = 60.0


def _now() -> float:
    return time.monotonic()


class TenantStorageExceeded(MoorageError):
    """The tenant keeps its storage ceiling; what would keep more was refused."""

    code = "tenant-storage-exceeded"
    http_status = 507
    for_caller = True  # a 5xx whose message is the caller's to read (what it keeps, what to do), not a fault

    def __init__(self, used: int, ceiling_mib: float, what: str) -> None:
        # The advice is in the message (as for store_mib): a guest that does not catch the error has it said once.
        super().__init__(f"this tenant keeps {used / MIB:.1f} MiB (its store, its instances' disks and its deploy "
                         f"packages), its storage ceiling is {ceiling_mib:g} MiB; {what} refused: delete end-users it "
                         f"no longer needs, shorten its retention, or ask the operator for more")
        self.used = used
        self.ceiling_mib = ceiling_mib


def measure(ts: "TenantStore") -> dict[str, int]:
    """What the tenant keeps, in bytes: ``store``, ``instances`` (disk, snapshot and checkpoint levels) and
    ``packages`` (its deploy packages)."""
    levels = ledger.storage(ts, since=0)
    return {"store": ts.footprint.tenant_bytes(), "instances": int(sum(levels.get(k, 0) for k in ledger.GAUGES)),
            "packages": ts.deployments.package_bytes()}


@dataclass
class _Level:
    parts: dict[str, int]
    at: float
    #: Bytes admitted since the measure.
    since: int = 0
    refreshing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: The tenant's own ceiling as last read (None: the installation's default), and when.
    own: float | None = None
    own_at: float = float("-inf")

    @property
    def bytes(self) -> int:
        return sum(self.parts.values()) + self.since


class TenantLevels:
    """One host process's last measure of each tenant (one per tenant: the count of tenants bounds it)."""

    def __init__(self) -> None:
        self._m: dict[str, _Level] = {}
        self._lock = threading.Lock()

    def _entry(self, tenant_id: str) -> _Level:
        with self._lock:
            m = self._m.get(tenant_id)
            if m is None:
                m = self._m[tenant_id] = _Level({}, at=float("-inf"))
            return m

    def _measure(self, ts: "TenantStore", asked: float) -> _Level:
        """Measure, unless another thread measured since ``asked`` (one measure at a time per tenant)."""
        m = self._entry(ts.tenant_id)
        with m.lock:
            if m.at <= asked:
                parts = measure(ts)
                m.parts, m.at, m.since = parts, _now(), 0
            m.refreshing = False
            return m

    def _refresh_behind(self, ts: "TenantStore", m: _Level) -> None:
        if m.refreshing:
            return
        m.refreshing = True

        def run() -> None:
            try:
                self._measure(ts, _now())
            except Exception as e:  # noqa: BLE001 - the last measure goes on answering; the next write asks again
                m.refreshing = False
                log.warning("could not measure a tenant's storage", tenant=ts.tenant_id, error=repr(e))

        asyncio.get_running_loop().run_in_executor(None, run)

    def current(self, ts: "TenantStore", *, fresher_than: float = MEASURE_EVERY_S) -> _Level:
        """The tenant's level, measured again (in this thread) if its measure is older than ``fresher_than``."""
        m = self._entry(ts.tenant_id)
        now = _now()
        return self._measure(ts, now - fresher_than) if now - m.at >= fresher_than else m

    def forget_limits(self, tenant_id: str) -> None:
        """The tenant's own limits are read again before its next write is judged."""
        m = self._entry(tenant_id)
        m.own_at = float("-inf")

    def ceiling(self, ts: "TenantStore", default: float, *, read: bool = True) -> float | None:
        """The tenant's ceiling in MiB (0: none): its own, else ``default``. Its own is read from the control
        plane when older than ``LIMITS_EVERY_S`` (in this thread); with ``read`` False that returns None instead."""
        m = self._entry(ts.tenant_id)
        if _now() - m.own_at >= LIMITS_EVERY_S:
            if not read:
                return None
            try:
                own = ts.backend.tenant_limits(ts.tenant_id).get("storage_mib")
                m.own = float(own) if isinstance(own, (int, float)) and not isinstance(own, bool) else None
            except Exception as e:  # noqa: BLE001 - the last one read goes on applying; asked again in a minute
                log.warning("could not read a tenant's limits", tenant=ts.tenant_id, error=repr(e))
            m.own_at = _now()
        return m.own if m.own is not None else default

    def grew(self, tenant_id: str, nbytes: int) -> None:
        """Something kept ``nbytes`` more for the tenant without asking (an instance's levels at its sleep):
        counted until its next measure."""
        with self._lock:
            m = self._m.get(tenant_id)
        if m is not None:
            m.since += nbytes

    def freed(self, tenant_id: str) -> None:
        """Something on this host freed room (a user forgotten): the tenant's next write measures again first."""
        m = self._entry(tenant_id)
        with m.lock:
            m.at = float("-inf")

    def dropped(self, tenant_id: str) -> None:
        """The tenant was deleted: its measures go."""
        with self._lock:
            self._m.pop(tenant_id, None)

    async def admit(self, ts: "TenantStore", ceiling_mib: float, nbytes: int, what: str) -> None:
        """Let ``what`` keep ``nbytes`` more for the tenant, or raise ``TenantStorageExceeded``."""
        cap = int(ceiling_mib * MIB)
        m = self._entry(ts.tenant_id)
        now = _now()
        if m.at == float("-inf") or (m.bytes + nbytes > cap and now - m.at >= RECHECK_S):
            m = await asyncio.to_thread(self.current, ts, fresher_than=0.0 if m.at == float("-inf") else RECHECK_S)
        elif now - m.at >= MEASURE_EVERY_S:
            self._refresh_behind(ts, m)
        if m.bytes + nbytes > cap:
            raise TenantStorageExceeded(m.bytes, ceiling_mib, what)
        m.since += nbytes


_LEVELS: "weakref.WeakKeyDictionary[Any, TenantLevels]" = weakref.WeakKeyDictionary()


def levels(ts: "TenantStore") -> TenantLevels:
    """The measures kept for ``ts``'s store (its backend: one per host process, shared by its API and its
    runtime)."""
    owner = ts.backend
    lv = _LEVELS.get(owner)
    if lv is None:
        lv = _LEVELS.setdefault(owner, TenantLevels())
    return lv


def limits_changed(store: Any, tenant_id: str) -> None:
    """The operator changed ``tenant_id``'s limits through this process: its next write reads them again."""
    lv = _LEVELS.get(store.backend)
    if lv is not None:
        lv.forget_limits(tenant_id)


def default_of(config: Any) -> float:
    """The operator's ``tenant_max_storage_mib``, every tenant's ceiling but those given their own (0: none)."""
    return float(getattr(config, "tenant_max_storage_mib", 0) or 0)


async def admit(config: Any, ts: "TenantStore", nbytes: int, what: str) -> None:
    """Before something keeps ``nbytes`` more for ``ts``'s tenant: refuse it past the tenant's ceiling (a no-op
    without one, and for a zero-retention agent's store, which keeps nothing on disk)."""
    if getattr(ts.backend, "ephemeral", False):
        return
    lv = levels(ts)
    ceiling = lv.ceiling(ts, default_of(config), read=False)
    if ceiling is None:
        ceiling = await asyncio.to_thread(lv.ceiling, ts, default_of(config))
    if ceiling:
        await lv.admit(ts, ceiling, nbytes, what)


def standing(config: Any, ts: "TenantStore") -> dict[str, Any] | None:
    """The tenant's storage as ``/v1/usage`` shows it, under its ceiling (None without one): ``limit`` and
    ``used`` in MiB (as the next write is judged: the last measure, taken again here if older than ``RECHECK_S``,
    plus what was admitted since), the measure's parts in bytes. Call it from a thread."""
    lv = levels(ts)
    ceiling = lv.ceiling(ts, default_of(config))
    if not ceiling:
        return None
    m = lv.current(ts, fresher_than=RECHECK_S)
    return {"limit": ceiling, "used": round(m.bytes / MIB, 3), "store_bytes": m.parts.get("store", 0),
            "instance_bytes": m.parts.get("instances", 0), "package_bytes": m.parts.get("packages", 0)}
