"""Garbage collection of templates nobody needs any more: deployment templates a redeploy replaced, fork templates of
forgotten users, and guest images no template is made on; on each host's disk and once in the object store (with
the deploy packages no deployment names: ``package_blobs.py``).

What is still needed is read from the store, the source of truth (``template_use``): live and fresh deployments,
the template every instance record names (awake, asleep or archived, on any host), the users that still have
instances. In the object store a template goes in two steps, so a host racing the collector never wakes an
instance onto a half-deleted one: first it is *retired* (a marker ``templates/<id>/retired.json`` is written and
its deployment's claim removed: no new fork uses it), then, at least ``settle_s`` later and only if the store still
says nobody needs it, the marker turns to ``deleting`` (fetchers refuse it from then on), the store is asked once
more, and only then are its objects deleted, the marker last. Every step is idempotent; several hosts may run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moorage.log import get_logger
from moorage.fleet.package_blobs import PackageCollector
from moorage.objects import Blobs, ObjectNotFound, ObjectStore
from moorage.store.model import FORKED_FROM, SHARED_TEMPLATE

if TYPE_CHECKING:
    from moorage.fleet.templates import PublishedTemplates
    from moorage.runtime.templates import Templates
    from moorage.store import Store

log = get_logger(__name__)

#: The marker of a retired (or being deleted) template or image, inside its prefix.
MARKER = "retired.json"

#: The bucket's instance objects are judged on the first collection and every this many after (12: an hour at the
#: default interval): it lists every object under ``instances/``.
INSTANCES_EVERY = 12


def forks_need_template(driver: str, shared: bool = False) -> bool:
    """Whether an instance forked from a template of ``driver`` needs that template for as long as it lives.

    A micro-VM fork's RAM delta and disk overlay are only valid against its template's RAM and disk, asleep or
    awake, on any host; a driver not named here is treated the same way (never guess that a template may go). A
    process-driver fork is a copy of its template's files except its ``shared`` directories (an agent's packages,
    ``template.json``'s ``shared``), which it binds from the template: it needs a template that has any."""
    return driver != "process" or shared


def template_shares(tdir: Path) -> bool:
    """Whether the template in ``tdir`` has shared directories its forks bind (``forks_need_template``)."""
    try:
        return bool(json.loads((tdir / "template.json").read_text()).get("shared"))
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class TemplateUse:
    """What the store says still needs templates, across every tenant (``template_use``)."""

    #: Deployments whose template must stay: live ones, and ones younger than the grace (a deploy in progress).
    deployments: frozenset[str]
    #: Template ids named by an instance record in any state: its fork may need it (``forks_need_template``).
    pinned: frozenset[str]
    #: (tenant, agent, user) of every instance record: fork templates of a user without one have no owner left.
    users: frozenset[tuple[str, str, str | None]]
    #: (tenant, record id) of every instance record not being deleted: its objects under ``instances/`` stay.
    instances: frozenset[tuple[str, str]] = frozenset()
    #: Every tenant read: only their instances' objects are judged (``BucketCollector.collect_instances``).
    tenants: frozenset[str] = frozenset()
    #: The packages a deployment (not deleted) of any tenant names; None: not read (no package file goes).
    packages: frozenset[str] | None = None
    #: When the read began (``time.time()``): a package file written after it may be a deploy's it did not see.
    read_at: float = 0.0


def template_use(store: "Store", *, grace_s: float, now: float | None = None) -> TemplateUse:
    """Read what needs templates from every tenant of ``store``. Blocking."""
    read_at = time.time()
    now = read_at if now is None else now
    deployments: set[str] = set()
    packages: set[str] = set()
    pinned: set[str] = set()
    users: set[tuple[str, str, str | None]] = set()
    instances: set[tuple[str, str]] = set()
    tenants: set[str] = set()
    for ts in store.operator.tenants():
        # The objects under ``instances/`` of a tenant not listed here are never collected (``collect_instances``),
        # on purpose. moorage removes a tenant only through ``DELETE /v1/tenants/{tenant}``
        # (runtime/tenant_delete.py), which deletes the objects under its prefix itself before its row goes (a
        # delete cut short leaves the row, marked, and is finished by sending it again), and a fleet's store is
        # PostgreSQL, which the online backup refuses. A tenant missing here otherwise went from outside moorage:
        # the database restored from a dump older than the tenant (the objects are then the only copy of its users'
        # sandboxes), its rows deleted by hand, or another installation shipping to the same bucket and prefix
        # (they are its live instances). None says garbage.
        tenants.add(ts.tenant_id)
        deployments.update(str(r[0]) for r in ts.read("SELECT live_deployment FROM agents WHERE live_deployment IS NOT NULL"))
        deployments.update(str(r[0]) for r in ts.read("SELECT id FROM deployments WHERE created_at > ?", (now - grace_s,)))
        packages.update(ts.deployments.packages())
        for rec in ts.sandboxes.list(limit=10_000_000):
            # ``meta.template``: the template its sandbox was last forked from (set when it is provisioned; a
            # reprovisioned instance's differs from the one its row was created with). Both are kept: a
            # provision in progress has only the row's. ``meta.shared_template``: the template whose shared
            # directories it binds since a redeploy changed its packages (runtime/instance_update.py).
            for tid in (rec.template_ref, rec.meta.get(FORKED_FROM), rec.meta.get(SHARED_TEMPLATE)):
                if isinstance(tid, str) and tid:
                    pinned.add(tid)
            users.add((ts.tenant_id, rec.scope.agent, rec.scope.user))  # user None: an agent-wide instance
            if rec.state != "deleted":
                instances.add((ts.tenant_id, rec.id))
    return TemplateUse(frozenset(deployments), frozenset(pinned), frozenset(users), frozenset(instances),
                       frozenset(tenants), frozenset(packages), read_at)


@dataclass
class GcReport:
    """What one collection did (counts)."""

    retired: int = 0
    deleted: int = 0
    restored: int = 0
    claims_deleted: int = 0
    images_deleted: int = 0
    objects_deleted: int = 0
    local_deleted: int = 0
    #: Instances whose objects were left in the object store after their record went (``collect_instances``).
    instances_deleted: int = 0
    #: Deploy packages deleted from the object store (``fleet/package_blobs.py``).
    packages_deleted: int = 0
    kept: dict[str, int] = field(default_factory=dict)

    def any(self) -> bool:
        return bool(self.retired or self.deleted or self.restored or self.claims_deleted or self.images_deleted
                    or self.local_deleted or self.instances_deleted or self.packages_deleted)


class BucketCollector:
    """The object store's half: published templates, deployment claims and guest images nobody needs."""

    def __init__(self, published: "PublishedTemplates", *, host: str = "", grace_s: float = 600.0,
                 settle_s: float = 60.0, pins: Callable[[str], bool] = forks_need_template,
                 package_blobs: "Blobs | None" = None) -> None:
        self.published = published
        #: The deploy packages in the object store, collected the same way (``fleet/package_blobs.py``).
        self.packages = PackageCollector(package_blobs, host=host, grace_s=grace_s, settle_s=settle_s) \
            if package_blobs is not None else None
        self.objects: ObjectStore = published.objects
        self.host = host
        self.grace_s = grace_s
        self.settle_s = settle_s
        self.pins = pins
        self._runs = 0

    # -- reading the bucket ---------------------------------------------------------------------------

    def _marker(self, prefix: str) -> dict[str, Any] | None:
        try:
            d = json.loads(self.objects.get_bytes(f"{prefix}/{MARKER}"))
        except ObjectNotFound:
            return None
        except ValueError:  # a torn marker is still a marker: the collection that wrote it goes on deleting
            return {"state": "deleting", "at": 0.0}
        return d if isinstance(d, dict) else {"state": "deleting", "at": 0.0}

    def _put_marker(self, prefix: str, state: str, at: float) -> None:
        self.objects.put_bytes(f"{prefix}/{MARKER}", json.dumps({"state": state, "at": at, "by": self.host}).encode())

    def _groups(self, top: str) -> dict[str, float]:
        """Names directly under ``top/`` with the newest modification time of anything under each. Blocking."""
        out: dict[str, float] = {}
        for o in self.objects.iter(f"{top}/"):
            name = o.key[len(top) + 1:].split("/", 1)[0]
            if name:
                out[name] = max(out.get(name, 0.0), o.modified)
        return out

    def _template_meta(self, template_id: str) -> tuple[dict[str, Any] | None, float]:
        """The published manifest's ``meta`` and when it was written; (None, 0) when there is no manifest."""
        key = self.published.shipper.manifest_key(self.published.prefix(template_id), "template")
        try:
            info = self.objects.head(key)
            meta = self.published.shipper.read_manifest(key).get("meta") or {}
        except ObjectNotFound:
            return None, 0.0
        except Exception as e:  # noqa: BLE001 - a damaged manifest: nothing can fork from it; judged by age alone
            log.warning("published template manifest unreadable", template=template_id, error=str(e))
            return {}, 0.0
        return meta, info.modified

    def _claims(self) -> dict[str, tuple[str | None, float]]:
        """deployment id -> (the template its claim names, when written)."""
        out: dict[str, tuple[str | None, float]] = {}
        for o in self.objects.iter("deployments/"):
            parts = o.key.split("/")
            if len(parts) != 3 or parts[2] != "template.json":
                continue
            try:
                tid = json.loads(self.objects.get_bytes(o.key)).get("template_id")
            except (ObjectNotFound, ValueError):
                tid = None
            out[parts[1]] = (str(tid) if tid else None, o.modified)
        return out

    def _delete_all(self, prefix: str) -> int:
        """Every object under ``prefix/``, the marker last (a crash in between leaves the marker: retried)."""
        n = 0
        marker = f"{prefix}/{MARKER}"
        for o in list(self.objects.iter(f"{prefix}/")):
            if o.key != marker:
                with contextlib.suppress(ObjectNotFound):
                    self.objects.delete(o.key)
                n += 1
        with contextlib.suppress(ObjectNotFound):
            self.objects.delete(marker)
        return n + 1

    # -- deciding -------------------------------------------------------------------------------------

    def _needed(self, template_id: str, meta: dict[str, Any] | None, written: float, use: TemplateUse,
                claims: dict[str, tuple[str | None, float]], now: float) -> str | None:
        """Why the template must stay (a word for the report), or None."""
        if now - written < self.grace_s:
            return "young"
        meta = meta or {}
        dep = meta.get("deployment_id")
        if dep and dep in use.deployments and claims.get(str(dep), (None, 0.0))[0] == template_id:
            return "deployment"
        if template_id in use.pinned and self.pins(str(meta.get("driver") or ""), bool(meta.get("shared"))):
            return "instance"
        return None

    def collect(self, use_of: Callable[[], TemplateUse], now: float | None = None) -> GcReport:
        """One collection over the bucket; ``use_of`` reads the store (called once, and once more before
        anything is deleted). Blocking."""
        now = time.time() if now is None else now
        rep = GcReport()
        use = use_of()
        claims = self._claims()
        templates = self._groups("templates")
        to_delete: list[str] = []
        metas: dict[str, dict[str, Any] | None] = {}
        for tid, newest in sorted(templates.items()):
            prefix = self.published.prefix(tid)
            meta, written = self._template_meta(tid)
            metas[tid] = meta
            why = self._needed(tid, meta, written if meta is not None else newest, use, claims, now)
            marker = self._marker(prefix)
            if why is not None:
                rep.kept[why] = rep.kept.get(why, 0) + 1
                if marker is not None and marker.get("state") == "retired":
                    # An instance named it after it was retired (rare: see settle_s): it stays, fetchable.
                    with contextlib.suppress(ObjectNotFound):
                        self.objects.delete(f"{prefix}/{MARKER}")
                    rep.restored += 1
                continue
            if marker is None:
                self._put_marker(prefix, "retired", now)
                rep.retired += 1
                dep = str((meta or {}).get("deployment_id") or "")
                if dep and claims.get(dep, (None, 0.0))[0] == tid:
                    # New forks of that deployment no longer use it (a rollback to it builds a new template).
                    with contextlib.suppress(ObjectNotFound):
                        self.objects.delete(self.published.marker_key(dep))
                    claims.pop(dep, None)
                    rep.claims_deleted += 1
                log.info("published template retired", template=tid, deployment=dep or None)
                if self.settle_s > 0:
                    continue
                marker = {"state": "retired", "at": now}
            if marker.get("state") == "deleting" or now - float(marker.get("at") or 0.0) >= self.settle_s:
                to_delete.append(tid)
        if to_delete:
            for tid in to_delete:
                self._put_marker(self.published.prefix(tid), "deleting", now)
            # Asked again now that fetchers refuse them: whatever the store names from here on keeps its template.
            use = use_of()
            for tid in to_delete:
                prefix = self.published.prefix(tid)
                tmeta = metas.get(tid) or {}
                if tid in use.pinned and self.pins(str(tmeta.get("driver") or ""), bool(tmeta.get("shared"))):
                    with contextlib.suppress(ObjectNotFound):
                        self.objects.delete(f"{prefix}/{MARKER}")
                    rep.restored += 1
                    continue
                rep.objects_deleted += self._delete_all(prefix)
                rep.deleted += 1
                metas.pop(tid, None)
                log.info("published template deleted", template=tid)
        # Claims of deployments nobody runs whose template is gone (a half-finished collection, a lost publisher).
        for dep, (tid, written) in claims.items():
            if dep in use.deployments or now - written < self.grace_s or (tid and tid in metas):
                continue
            with contextlib.suppress(ObjectNotFound):
                self.objects.delete(self.published.marker_key(dep))
            rep.claims_deleted += 1
        self._collect_images(rep, now)
        if self.packages is not None:
            rep.packages_deleted += self.packages.collect(use, use_of, now).deleted
        self._runs += 1
        if self._runs % INSTANCES_EVERY == 1 or INSTANCES_EVERY == 1:
            self.collect_instances(rep, use_of, now)
        if rep.any():
            log.info("object store template collection", retired=rep.retired, deleted=rep.deleted,
                     restored=rep.restored, claims=rep.claims_deleted, images=rep.images_deleted,
                     packages=rep.packages_deleted)
        return rep

    def collect_instances(self, rep: GcReport, use_of: Callable[[], TemplateUse], now: float) -> None:
        """Delete the objects of instances whose record is gone or being deleted (``instances/<tenant>/<id>/``),
        once nothing of theirs was written for ``grace_s``: what a shipment wrote after its user was forgotten (a
        host cut off in the middle of one, a manifest written just after the record was read: FleetMember.ship).
        The store is read after the bucket is listed: an instance's row exists before any object of it is
        written, so one missing then is gone for good. Only tenants the store knows are judged. Blocking."""
        newest: dict[tuple[str, str], float] = {}
        for o in self.objects.iter("instances/"):
            parts = o.key.split("/", 3)
            if len(parts) == 4 and parts[1] and parts[2]:
                key = (parts[1], parts[2])
                newest[key] = max(newest.get(key, 0.0), o.modified)
        if not newest:
            return
        use = use_of()
        for (tenant, sid), written in sorted(newest.items()):
            if tenant not in use.tenants or (tenant, sid) in use.instances or now - written < self.grace_s:
                continue
            n = self.objects.delete_prefix(f"instances/{tenant}/{sid}/")
            rep.objects_deleted += n
            rep.instances_deleted += 1
            log.warning("removed the objects of an instance whose record is gone", tenant=tenant, instance=sid,
                        objects=n)

    def images_in_use(self) -> set[str]:
        """Digests of the guest images every published template (retired ones too) was made on. Blocking."""
        used: set[str] = set()
        for tid in self._groups("templates"):
            meta, _ = self._template_meta(tid)
            image = (meta or {}).get("image")
            if isinstance(image, dict) and image.get("digest"):
                used.add(str(image["digest"]))
        return used

    def _collect_images(self, rep: GcReport, now: float) -> None:
        images = self._groups("images")
        if not images:
            return
        used = self.images_in_use()
        to_delete: list[str] = []
        for digest, newest in sorted(images.items()):
            prefix = self.published.image_prefix(digest)
            marker = self._marker(prefix)
            if digest in used or now - newest < self.grace_s:
                if marker is not None and marker.get("state") == "retired":
                    with contextlib.suppress(ObjectNotFound):
                        self.objects.delete(f"{prefix}/{MARKER}")
                continue
            if marker is None:
                self._put_marker(prefix, "retired", now)
                if self.settle_s > 0:
                    continue
                marker = {"state": "retired", "at": now}
            if marker.get("state") == "deleting" or now - float(marker.get("at") or 0.0) >= self.settle_s:
                to_delete.append(digest)
        if not to_delete:
            return
        for digest in to_delete:
            self._put_marker(self.published.image_prefix(digest), "deleting", now)
        # A template published meanwhile names its image before it checks the image's marker (publish): one of
        # the two sees the other.
        used = self.images_in_use()
        for digest in to_delete:
            prefix = self.published.image_prefix(digest)
            if digest in used:
                with contextlib.suppress(ObjectNotFound):
                    self.objects.delete(f"{prefix}/{MARKER}")
                continue
            rep.objects_deleted += self._delete_all(prefix)
            rep.images_deleted += 1
            log.info("guest image deleted from the object store", digest=digest[:16])


class TemplateGC:
    """Runs the collection for one host: its own disk, then (with an object store) the bucket."""

    def __init__(self, store: "Store", templates: "Templates", published: "PublishedTemplates | None" = None, *,
                 host: str = "", grace_s: float = 600.0, settle_s: float = 60.0, interval_s: float = 300.0,
                 pins: Callable[[str], bool] = forks_need_template) -> None:
        self.store = store
        self.templates = templates
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.pins = pins
        self.bucket = BucketCollector(published, host=host, grace_s=grace_s, settle_s=settle_s, pins=pins,
                                      package_blobs=templates.package_blobs) if published is not None else None
        # A host trusts a claim check for at most a quarter of the settle time (see Templates.claim_ttl_s).
        templates.claim_ttl_s = min(5.0, settle_s / 4)
        self._lock = asyncio.Lock()
        self._soon: asyncio.Task[Any] | None = None

    def _use(self) -> TemplateUse:
        return template_use(self.store, grace_s=self.grace_s)

    async def run(self, now: float | None = None) -> GcReport:
        """One collection (single-flight in this process)."""
        async with self._lock:
            use = await asyncio.to_thread(self._use)
            local = await self.templates.collect(use, grace_s=self.grace_s, now=now, pins=self.pins)
            rep = GcReport()
            if self.bucket is not None:
                rep = await asyncio.to_thread(self.bucket.collect, self._use, now)
            rep.local_deleted = local
            return rep

    def soon(self) -> None:
        """Collect in the background now (after a deploy): at most one waiting run."""
        if self._soon is not None and not self._soon.done():
            return
        self._soon = asyncio.get_running_loop().create_task(self._quiet_run(), name="template-gc-now")

    async def _quiet_run(self) -> None:
        try:
            await self.run()
        except Exception as e:  # noqa: BLE001 - the next periodic run tries again
            log.warning("template collection failed", error=str(e))

    async def loop(self) -> None:
        """Every ``interval_s``, with the host's other periodic duties."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self._quiet_run()

    async def close(self) -> None:
        if self._soon is not None and not self._soon.done():
            self._soon.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._soon
