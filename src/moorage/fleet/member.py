"""This host's membership in a fleet: registered and heartbeating in the store, shipping instance snapshots.

An instance is owned by the host its record names, under a fencing epoch that changes whenever another host
takes it; the owner's lease holds while its heartbeat is fresh (``lease_ttl_s``). A sleeping instance whose last
sleep was shipped can be woken by any host; one that is awake elsewhere is served by its owner (requests are
forwarded); one whose owner stopped heartbeating is taken over from its last shipped snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from moorage import clock
from moorage.errors import ConflictError, MoorageError, NotFound
from moorage.fleet.forward import Forwarder
from moorage.fleet.hosts import HostInfo, HostRegistry, check_host_id
from moorage.fleet.ship import INDEX_NAME, Shipper, ShipReport, SnapshotUnavailable
from moorage.log import FailingRounds, get_logger
from moorage.objects import ObjectStore, ObjectStoreUnavailable
from moorage.store import SandboxRecord
from moorage.store.base import Backend

log = get_logger(__name__)

#: Shipped snapshots kept per instance: the newest (what a wake uses) and two fallbacks should it be damaged.
SNAPSHOTS_KEPT = 3

#: What makes a folder under a sandbox's ``checkpoints/`` a written checkpoint: its record, written last (the
#: process driver's, the micro-VM driver's); a folder without one (being made or removed) is none.
CHECKPOINT_RECORDS = ("checkpoint.json", "snapshot.json")


class NotPublished(ConflictError):
    """A snapshot was not published: the instance's record no longer names this host at the epoch it was shipped
    under (another host took it over), or is gone or being deleted (its user was forgotten while this host was cut
    off, or alongside the shipment)."""

    code = "snapshot-not-published"

    def __init__(self, record_id: str, why: str) -> None:
        super().__init__(f"the snapshot of instance {record_id} was not published: {why}",
                         hint="nothing to do: the host that holds the instance now ships its own")
        self.why = why


def checkpoints_in(manifest: dict[str, Any]) -> dict[str, int]:
    """The sandbox checkpoints a shipped snapshot holds: name to the bytes of its files."""
    sizes: dict[str, int] = {}
    named: set[str] = set()
    for e in manifest.get("entries") or ():
        parts = str(e.get("path") or "").split("/")
        if len(parts) < 3 or parts[0] != "checkpoints" or parts[1].startswith(".") or e.get("type") != "file":
            continue
        sizes[parts[1]] = sizes.get(parts[1], 0) + int(e.get("size") or 0)
        if len(parts) == 3 and parts[2] in CHECKPOINT_RECORDS:
            named.add(parts[1])
    return {n: b for n, b in sizes.items() if n in named}


class FleetMember:
    """This host in the fleet: its row in ``hosts`` kept fresh, its shipments, fetches and forwards."""

    def __init__(self, backend: Backend, objects: ObjectStore, driver: Any, *, host_id: str, url: str,
                 lease_ttl_s: float = 15.0, heartbeat_s: float = 3.0) -> None:
        if not callable(getattr(driver, "portable", None)):
            raise MoorageError(f"the {driver.name} driver cannot ship snapshots between hosts",
                               hint="a fleet (object_store_url with a PostgreSQL store) needs a driver whose sandboxes "
                                    "can move between hosts: process or microvm")
        if heartbeat_s * 2 > lease_ttl_s:
            raise MoorageError(f"heartbeat every {heartbeat_s} s cannot keep a {lease_ttl_s} s lease",
                               hint="make lease_ttl_s at least twice heartbeat_s")
        self.registry = HostRegistry(backend)
        self.objects = objects
        self.shipper = Shipper(objects)
        self.driver = driver
        self.host_id = check_host_id(host_id)
        self.url = url.rstrip("/")
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_s = heartbeat_s
        self.incarnation = uuid.uuid4().hex
        #: Called with no argument after a heartbeat gap longer than the lease: our leases may have been taken.
        self.on_lease_gap: Callable[[], Any] | None = None
        #: Called once when an operator marks this host ``draining`` (``moorage hosts drain``).
        self.on_drain: Callable[[], Any] | None = None
        #: Draining: instances this host does not already hold awake are brought up on other hosts.
        self.draining = False
        self.load: Callable[[], dict[str, Any]] = dict
        self._last_beat = 0.0  # on the store's clock (``moorage.clock``), as heartbeats are written
        self._beat_mono = 0.0
        #: When the last heartbeat the store took was sent (monotonic): the store stamped it after this.
        self._beat_sent = 0.0
        #: When this host's heartbeat came back after failing longer than the lease (the store was out of reach).
        self._back_at = 0.0
        self._hosts: dict[str, tuple[float, HostInfo]] = {}
        self._task: asyncio.Task[None] | None = None
        #: The heartbeat's own thread: with the default executor's few threads all busy (shipments during a drain,
        #: each longer than the lease), a heartbeat queued behind them let this host's leases lapse while it lived.
        self._beat_thread = ThreadPoolExecutor(1, thread_name_prefix="moorage-heartbeat")
        self._drain_task: asyncio.Task[Any] | None = None
        self.forwarder = Forwarder(self.host_id)
        self.forwarder.lapsed, self.forwarder.watch_every_s = self.lapsed, heartbeat_s
        #: Fingerprints of the installation secrets this host runs with (``api.auth.installation_fingerprints``):
        #: joining beside a live host whose differ is refused. None: not compared (a host made in a test).
        self.secrets: dict[str, Any] | None = None
        #: One push or prune at a time per instance on this host (a prune must not delete what a push counts on).
        self._ship_locks: dict[str, threading.Lock] = {}
        self._ship_locks_guard = threading.Lock()

    # -- membership -----------------------------------------------------------------------------------

    async def join(self) -> None:
        await asyncio.to_thread(self.registry.register, self.host_id, self.url, self.incarnation, self.secrets,
                                ttl_s=self.lease_ttl_s)
        self._last_beat, self._beat_mono = clock.now(), time.monotonic()
        self._beat_sent = self._beat_mono
        self._task = asyncio.create_task(self._beat_loop(), name="fleet-heartbeat")
        log.info("joined the fleet", host=self.host_id, url=self.url, lease_ttl_s=self.lease_ttl_s)

    async def leave(self, state: str = "gone") -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self.forwarder.close()
        self._beat_thread.shutdown(wait=False)
        self.shipper.close()
        with contextlib.suppress(MoorageError):
            await asyncio.to_thread(self.registry.set_state, self.host_id, state, self.incarnation)

    async def _beat_loop(self) -> None:
        failures = FailingRounds(log, "fleet heartbeat", level=logging.WARNING)
        while True:
            await asyncio.sleep(self.heartbeat_s)
            gap = time.monotonic() - self._beat_mono  # not the wall clock: a step of it is no gap
            try:
                sent = time.monotonic()
                self._last_beat, state = await asyncio.get_running_loop().run_in_executor(
                    self._beat_thread, self.registry.heartbeat, self.host_id, self.incarnation, self.load())
                self._beat_mono, self._beat_sent = time.monotonic(), sent
            except ConflictError as e:
                log.error("fleet heartbeat refused", host=self.host_id, error=str(e))
                continue
            except Exception as e:  # the store is unreachable: leases lapse, other hosts take over
                failures.failed(e, host=self.host_id)
                continue
            failures.ok()
            if gap > self.lease_ttl_s:
                self._back_at = self._last_beat
            if state == "draining" and not self.draining:
                self.draining = True
                log.info("draining: sleeping and shipping every instance, then leaving", host=self.host_id)
                if self.on_drain is not None:
                    self._drain_task = asyncio.create_task(self.on_drain(), name="fleet-drain")
            if gap > self.lease_ttl_s and self.on_lease_gap is not None:
                log.warning("heartbeat gap longer than the lease: checking which instances are still ours",
                            host=self.host_id, gap_s=round(gap, 1))
                try:
                    await self.on_lease_gap()
                except Exception as e:
                    log.error("lease check after a gap failed", error=str(e))

    def alive(self, info: HostInfo) -> bool:
        """Whether ``info``'s host holds its leases, as far as this host can tell. An old heartbeat means a dead
        host only while this host itself reaches the store: when the store was out of reach for everyone (a
        PostgreSQL restart or outage longer than the lease), every heartbeat is old and no host is dead. So until
        this host has beaten again for one lease, it takes no host for dead but one that left (``gone``)."""
        if info.state == "gone":
            return False
        if info.alive(self.lease_ttl_s):
            return True
        now = clock.now()
        in_touch = now - self._last_beat <= self.lease_ttl_s and now - self._back_at >= self.lease_ttl_s
        return not in_touch

    def holds_own_lease(self) -> bool:
        """Whether this host's own lease holds as far as it can tell: the last heartbeat the store took was sent
        less than the lease, less half a heartbeat, ago. Another host takes the lease for lapsed once the store's
        stamp of it (made after the send) is a lease old, so a host cut off from the store stops serving what it
        holds (its open app sockets) before that."""
        return self._beat_sent == 0.0 or time.monotonic() - self._beat_sent < self.lease_ttl_s - self.heartbeat_s / 2

    def lapsed(self, host_id: str) -> bool:
        """Whether ``host_id``'s lease has lapsed (or it left, or never joined), as far as this host can tell: a
        forward waiting on that host's answer stops waiting (``Forwarder``). Blocking; its row read at most once per
        half heartbeat, however many forwards wait."""
        info = self.host(host_id, max_age_s=self.heartbeat_s / 2)
        return info is None or not self.alive(info)

    def host(self, host_id: str, *, max_age_s: float = 1.0) -> HostInfo | None:
        """The host's row (cached for ``max_age_s``), or None when it never registered. Blocking."""
        now = time.monotonic()
        hit = self._hosts.get(host_id)
        if hit is not None and now - hit[0] <= max_age_s:
            return hit[1]
        try:
            info = self.registry.get(host_id)
        except NotFound:
            return None
        self._hosts[host_id] = (now, info)
        return info

    def elsewhere(self) -> HostInfo | None:
        """An active host other than this one, alive, with the fewest awake instances (for a draining host). Blocking."""
        others = [h for h in self.registry.list() if h.id != self.host_id and h.state == "active"
                  and h.alive(self.lease_ttl_s)]
        return min(others, key=lambda h: (int(h.load.get("awake", 0)), h.id), default=None)

    # -- snapshots ------------------------------------------------------------------------------------

    @staticmethod
    def prefix(tenant_id: str, record: SandboxRecord) -> str:
        return f"instances/{tenant_id}/{record.id}"

    def _dir(self, record: SandboxRecord) -> Path:
        return Path(self.driver.root) / record.id

    def ship(self, tenant_id: str, record: SandboxRecord, epoch: int, *,
             held: Callable[[], SandboxRecord | None] | None = None) -> dict[str, Any]:
        """Ship the sandbox of ``record`` (asleep, or frozen by the caller for the copy); returns what its record
        keeps (``meta.shipped``). Blocking.

        ``held`` reads the instance's record as it is now (None once it is gone): read after the chunks are stored
        and before the manifest is written, the snapshot is published only while the record still names this host
        at ``epoch``, else ``NotPublished`` is raised. When the record is gone or deleted (its user forgotten while
        this host was cut off, or alongside the shipment) the instance's objects are removed again, so the
        shipment leaves nothing of that user in the object store. The record is read once more after the manifest
        is written: a forget or a takeover between the first read and the write (this host paused there, say) has
        marked it deleted or taken by then (``lifecycle/forget.py`` marks it before it deletes the objects), so
        the snapshot is withdrawn (with a deleted instance's objects all); one after that read deletes it itself."""
        name = f"{epoch:06d}-{time.time_ns()}"
        prefix = self.prefix(tenant_id, record)

        def still_held(published: str | None = None) -> None:
            cur = held() if held is not None else record
            if cur is None or cur.state == "deleted":
                removed = self.delete_instance(tenant_id, record)
                log.warning("instance forgotten while its snapshot was shipped: its objects removed again",
                            instance=record.id, objects=removed)
                raise NotPublished(record.id, "it was deleted meanwhile")
            if cur.host != self.host_id or cur.lease_epoch != epoch:
                if published is not None:  # the new holder's own snapshots stay
                    self.objects.delete(published)
                raise NotPublished(record.id, f"host {cur.host!r} holds it now (epoch {cur.lease_epoch}, "
                                              f"shipped under {epoch})")

        with self._ship_lock(record.id):
            rep: ShipReport = self.shipper.push(self._dir(record), prefix, name, include=self.driver.portable,
                                                meta={"host": self.host_id, "epoch": epoch}, epoch=epoch,
                                                before_publish=still_held if held is not None else None)
            if held is not None:
                still_held(published=rep.key)
            log.info("snapshot shipped", instance=record.id, key=rep.key, chunks=rep.chunks_moved,
                     bytes=rep.bytes_moved, ms=round(rep.seconds * 1000, 1))
            try:  # the instance's older snapshots (all but its fallbacks) and the chunks only they used
                snapshots, chunks = self.shipper.prune(self._dir(record), prefix, keep=SNAPSHOTS_KEPT)
                if snapshots:
                    log.debug("old snapshots deleted", instance=record.id, snapshots=snapshots, chunks=chunks)
            except Exception as e:  # noqa: BLE001 - the shipment stands; the next one prunes again
                log.warning("old snapshots could not be deleted", instance=record.id, error=str(e))
        return {"key": rep.key, "at": clock.now(), "host": self.host_id, "epoch": epoch,
                "bytes": rep.bytes_total, "ms": round(rep.seconds * 1000, 1)}

    def _ship_lock(self, record_id: str) -> threading.Lock:
        with self._ship_locks_guard:
            return self._ship_locks.setdefault(record_id, threading.Lock())

    def make_local(self, tenant_id: str, record: SandboxRecord, previous_epoch: int) -> dict[str, Any]:
        """Before waking ``record`` here (we hold its claim, at ``record.lease_epoch``): make the local copy the
        right one. Returns where it resumes from (``meta.resumed_from``): ``from`` is ``local`` (this host's
        disk), ``shipped`` (fetched; ``key`` and ``at`` name the snapshot) or ``none`` (no usable copy anywhere:
        the caller provisions it again from the template; its acknowledged turns are in the store). Blocking.

        The local copy is used as it is when this host held the instance under ``previous_epoch`` (it never left,
        so its copy is the newest, run or not), or when it is exactly the last shipped snapshot. A damaged or
        missing shipped snapshot falls back to the instance's older ones, newest first; never another's."""
        d = self._dir(record)
        local_key, local_epoch = self.shipper.local_state(d)
        shipped = record.meta.get("shipped") if isinstance(record.meta.get("shipped"), dict) else None
        key = shipped.get("key") if shipped else None
        if local_epoch is not None and (local_epoch == previous_epoch == record.lease_epoch or (key and local_key == key)):
            self.shipper.mark_running(d, record.lease_epoch)
            return {"from": "local", "key": local_key, "host": self.host_id}
        prefix = self.prefix(tenant_id, record)

        def candidates() -> Iterator[str]:
            if key:
                yield key
            # Listed only when the newest one failed (or none was recorded): the instance's own, newest first.
            yield from sorted((o.key for o in self.objects.iter(f"{prefix}/snapshots/") if o.key != key), reverse=True)

        unusable: list[dict[str, str]] = []
        for i, k in enumerate(candidates()):
            try:
                rep = self.shipper.pull(k, prefix, d, epoch=record.lease_epoch)
            except SnapshotUnavailable as e:
                log.error("shipped snapshot unusable; trying an older one", instance=record.id, key=k, error=str(e))
                unusable.append({"key": k, "error": str(e)[:300]})
                continue
            self.driver.forget_handle(record.id)
            try:
                # Paths of the host that shipped it (template, image, disk backing) become this host's.
                self.driver.adopt_fetched(record.id)
            except BaseException:
                (d / INDEX_NAME).unlink(missing_ok=True)  # not "exactly the shipped snapshot": fetched again next time
                raise
            self.shipper.mark_running(d, record.lease_epoch)
            if i > 0:  # what the newer snapshots held (the disk since this one was shipped) is lost
                log.error("instance resumes from an older snapshot: its newest one was unusable", instance=record.id,
                          key=k, unusable=[u["key"] for u in unusable])
            else:
                log.info("snapshot fetched", instance=record.id, key=k, chunks=rep.chunks_moved,
                         bytes=rep.bytes_moved, ms=round(rep.seconds * 1000, 1))
            return {"from": "shipped", "key": k, "host": self.host_id, "fallback": i > 0,
                    "at": shipped.get("at") if shipped and k == key else None,
                    "fetch_ms": round(rep.seconds * 1000, 1), "fetched_bytes": rep.bytes_moved,
                    **({"unusable": unusable} if unusable else {})}
        if unusable:
            log.error("no shipped snapshot of the instance is usable: it is provisioned again from its template",
                      instance=record.id, unusable=[u["key"] for u in unusable])
        return {"from": "none", "key": None, "host": self.host_id, **({"unusable": unusable} if unusable else {})}

    def shipped_checkpoints(self, record: SandboxRecord) -> dict[str, int] | None:
        """The sandbox checkpoints (name to bytes) in the snapshot a wake of ``record`` on any host resumes from (its
        last shipped one): what a host answers for an instance whose own host is gone. Empty when it never shipped
        one (a wake provisions it again); None when that snapshot cannot be read now. Blocking."""
        shipped = record.meta.get("shipped")
        key = shipped.get("key") if isinstance(shipped, dict) else None
        if not isinstance(key, str):
            return {}
        try:
            return checkpoints_in(self.shipper.read_manifest(key))
        except (SnapshotUnavailable, ObjectStoreUnavailable) as e:
            log.warning("checkpoints of a shipped snapshot not listed", instance=record.id, key=key, error=str(e))
            return None

    def evictable(self) -> list[tuple[float, str, int]]:
        """Sandbox directories on this host that are exactly a shipped snapshot (the object store has them):
        (last used, sandbox id, bytes), least recently used first. Blocking."""
        from moorage.sandbox.process_fs import disk_usage

        out = []
        root = Path(self.driver.root)
        for d in root.iterdir() if root.is_dir() else ():
            if d.name.startswith(".") or not d.is_dir():
                continue
            key, _ = self.shipper.local_state(d)
            if key is None:
                continue  # running, or changed since its last shipment: this host's copy is the only newest one
            try:
                used = (d / INDEX_NAME).stat().st_mtime
            except OSError:
                continue
            out.append((used, d.name, disk_usage(d)))
        return sorted(out)

    def copies(self) -> list[tuple[str, str]]:
        """(sandbox id, tenant id) of every instance directory on this host that was shipped or fetched (its index
        names the instance's prefix in the object store). Blocking."""
        out = []
        root = Path(self.driver.root)
        for d in root.iterdir() if root.is_dir() else ():
            if d.name.startswith(".") or not d.is_dir():
                continue
            index = self.shipper._load_index(d)
            for prefix in (index.get("stored") or {}):
                parts = str(prefix).split("/")
                if len(parts) == 3 and parts[0] == "instances" and parts[2] == d.name:
                    out.append((d.name, parts[1]))
                    break
        return out

    def delete_instance(self, tenant_id: str, record: SandboxRecord) -> int:
        """Remove every shipped object of the instance (retention, forget). Blocking."""
        return self.objects.delete_prefix(self.prefix(tenant_id, record) + "/")
