"""Template snapshots per deployment: a booted guest with the agent's code loaded, ready to fork.

Templates are files on the host (under ``<data_dir>/templates``). With an object store (a fleet) the first host
to build a deployment's template publishes it and every other host fetches that one (``fleet/templates.py``): an
instance's memory and disk are only valid against the template it was forked from. Without one, a host rebuilds a
missing template from the deployment's package. Fork templates, snapshots of one user's instance, are recorded with
that user (``templates/forks/``) so that forgetting the user deletes them too.

``collect`` removes this host's templates nobody needs any more (after a redeploy; forks of forgotten users), as
``fleet/gc.py`` decides from the store; in a fleet a cached template is used only while its deployment's claim in
the object store still names it (a retired one is replaced by a new build or the published one).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping

from moorage.errors import MoorageError
from moorage.log import get_logger
from moorage.objects import Blobs, ObjectNotFound
from moorage.runtime.package import AgentPackageError, unpack
from moorage.runtime.package_files import PackageFiles
from moorage.runtime.private_files import private_dir, write_private
from moorage.runtime import booted, deploy_apt, deploy_packages
from moorage.runtime.booted import BootedTemplates
from moorage.runtime.sizing import spec_for
from moorage.sandbox import RemoteError, Sandbox, SandboxDriver, TemplateRef
from moorage.store import Deployment

if TYPE_CHECKING:
    from moorage.fleet.gc import TemplateGC, TemplateUse

log = get_logger(__name__)

#: Where a deployment's files live inside every sandbox.
AGENTS_DIR_IN_GUEST = "/work/.moorage/agents"


def agent_dir(deployment_id: str) -> str:
    return f"{AGENTS_DIR_IN_GUEST}/{deployment_id}"


class AgentLoadFailed(AgentPackageError):
    """The agent's code imported badly inside a sandbox (ImportError, missing handler, ...)."""

    code = "agent-load-failed"


async def push_and_load(sandbox: Sandbox, deployment: Deployment, archive: bytes) -> dict[str, Any]:
    """Make ``deployment`` the agent version loaded in ``sandbox`` (files written first if missing)."""
    base = agent_dir(deployment.id)
    if await sandbox.stat(f"{base}/moorage.toml") is None:
        for name, data in sorted(unpack(archive).items()):
            await sandbox.write_file(f"{base}/{name}", data)
    try:
        return await sandbox.channel.call("agent.load", {"deployment_id": deployment.id, "path": base}, timeout=120)
    except RemoteError as e:
        where = e.data.get("where") if isinstance(e.data, dict) else None
        # Where in the agent's files it failed, when it was there (an import, a name at module level); the message
        # says the rest (the traceback's last line only repeated it).
        raise AgentLoadFailed(f"{e.message}", hint=(f"raised at {where[:500]}; " if isinstance(where, str) and where
                                                    else "") + "fix the agent and deploy again") from e


def boot_env(manifest: Mapping[str, Any], requirements: bytes | None) -> dict[str, str]:
    """The environment of a deployment's sandboxes (its template's spec; every fork starts with it): the network's
    (``vm_network.guest_env``), the packages' path when it has ``requirements.txt``, the relay for apt's downloads."""
    from moorage.runtime.vm_network import guest_env

    env = dict(guest_env(manifest))
    if requirements:
        env.update(deploy_packages.guest_env(requirements))
    if deploy_apt.packages_of(manifest):  # the builder's relay carries apt's downloads
        env["MOORAGE_NETWORK"] = "1"
    return env


#: A deployment's template record (``templates/<deployment id>.json``) names the package cache entries its build
#: installed from (``package-cache/``) under this key, a fetched template's those published beside it (which its
#: instances here may fetch); a record without it (one written before it existed, or whose listing failed) names
#: nothing it is sure of, and the cache is then not collected (``_collect_package_cache``).
PACKAGE_CACHE = "package_cache"


def _ref_json(ref: TemplateRef) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(ref).items()}


def _ref_of(d: dict[str, Any], templates_dir: Path) -> TemplateRef:
    """A template record read back: the template is ``templates_dir/<id>`` (where this host's driver keeps its
    templates), never the path recorded with it, which names the original's files in a copied or moved data
    directory (docs/operations.md)."""
    return TemplateRef(d["id"], d["driver"], templates_dir / d["id"], d.get("source_sandbox"),
                       d.get("created_at", 0.0), d.get("includes_memory", False))


class Templates:
    def __init__(self, root: Path, driver: SandboxDriver, packages: Path, package_blobs: Blobs | None = None) -> None:
        self.root = root
        self.driver = driver
        self.packages = packages
        #: Every deployment's package in the object store (a fleet): a host that lacks one fetches it from there.
        self.package_blobs = package_blobs
        #: The package files on this host's disk, collected when no deployment names them (``collect``).
        self.package_files = PackageFiles(packages)
        private_dir(self.root)
        #: Deploy-time package installs go through this (``egress_of(runtime)`` when the runtime set it).
        self.egress: Any = None
        #: One lock per deployment while something holds or waits on it (``_deployment_lock``), then dropped: a
        #: host up for months built thousands of deployments, and kept a lock for each.
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}
        #: Ids of the templates time-travel forks of this process are making or forking from (``fork_template``).
        self._forking: set[str] = set()
        #: Templates in the object store (a fleet, set by the host): fetched instead of built, published when built.
        self.published: Any = None
        #: The host's template collector (set by the host); a deploy asks it to run soon.
        self.gc: "TemplateGC | None" = None
        #: Awaited with a template's id as the collection drops a replaced deployment's template: the warm pool of
        #: it goes too (the runtime sets it). Another host of a fleet whose agent was redeployed or deleted kept
        #: refilling forks of a template that was gone.
        self.on_retired: Callable[[str], Awaitable[Any]] | None = None
        #: Fleet: how long a check that the deployment's claim names the cached template is trusted (one GET per
        #: provisioning otherwise, 12 ms against SeaweedFS here). Kept well under the collector's settle time
        #: (``TemplateGC`` sets it): a fork made from a template retired meanwhile names it in the store before the
        #: collector looks again, and so brings it back.
        self.claim_ttl_s = 0.0
        self._claim_checked: dict[str, tuple[str, float]] = {}
        #: Fleet: deployment id -> the claimed template this host found it cannot fork (a QEMU upgrade); the
        #: template this host builds instead replaces that claim (``PublishedTemplates.publish``'s ``replacing``).
        self._outdated_claims: dict[str, str] = {}
        #: What builders start from (``runtime/booted.py``).
        self.booted = BootedTemplates(self.root, driver, _ref_json, lambda d: _ref_of(d, self._templates_dir()))

    def _egress(self) -> Any:
        """The egress service deploy-time installs go through (a runtime sets its own; else from the config)."""
        if self.egress is None:
            from moorage.egress import Egress

            self.egress = Egress.from_config(self.driver.config)
        return self.egress

    async def install_packages(self, sandbox: Sandbox, requirements: bytes, owner: str, say: Any,
                               record: Any = None, template: TemplateRef | None = None,
                               kept: Any = None) -> str:
        """``deploy_packages.install`` into ``sandbox`` with this host's package cache and deploy-time egress (a
        template's builder, or an instance whose deployment's packages changed: ``instance_update``). In a fleet,
        a missing cache entry is fetched from what ``template``'s builder published beside it."""
        return await deploy_packages.install(sandbox, requirements, self.driver.config, self._egress(),
                                             self.root / "package-cache", say, owner=owner, record=record,
                                             fetch=self._published_fetch(template, "site"), kept=kept)

    async def update_apt(self, sandbox: Sandbox, packages: list[str], owner: str, say: Any,
                         template: TemplateRef | None = None) -> str:
        """``deploy_apt.update`` of an instance whose deployment's ``apt`` list changed, with this host's cache; in
        a fleet, a missing entry is fetched from what ``template``'s builder published beside it."""
        return await deploy_apt.update(sandbox, packages, self.driver.config, self._egress(),
                                       self.root / "package-cache", say, owner=owner,
                                       fetch=self._published_fetch(template, "apt"))

    def _published_fetch(self, template: TemplateRef | None, kind: str) -> Callable[[str, Path], bool] | None:
        """Fetches a package cache entry of ``kind`` published beside ``template`` (a fleet), or None."""
        published = self.published
        if published is None or template is None:
            return None
        tid = template.id
        return lambda key, dest: published.fetch_packages(tid, key, dest, kind)

    def archive(self, deployment: Deployment) -> bytes:
        path = self.packages / f"{deployment.package_sha256}.tar.gz"
        if not path.exists() and self.package_blobs is not None:
            with contextlib.suppress(ObjectNotFound):  # verified against its digest; damage raises ObjectCorrupt
                self.package_blobs.get_blob(deployment.package_sha256, path)
        if not path.exists():
            raise MoorageError(f"package of deployment {deployment.number} is missing on this host ({path})",
                               hint="deploy the agent again")
        return path.read_bytes()

    def _meta(self, deployment_id: str) -> Path:
        return self.root / f"{deployment_id}.json"

    def cached(self, deployment_id: str) -> TemplateRef | None:
        p = self._meta(deployment_id)
        if not p.exists():
            return None
        d = json.loads(p.read_text())
        ref = _ref_of(d, self._templates_dir())
        if d.get("driver") != self.driver.name or not ref.path.exists():
            return None
        why = self._outdated(ref)
        if why is not None:  # an upgrade (docs/operations.md): its forks keep it; new users get a new template
            log.warning("the deployment's template cannot be forked on this host any more; building it again",
                        deployment=deployment_id, template=ref.id, reason=why)
            return None
        return ref

    def _outdated(self, ref: TemplateRef) -> str | None:
        """Why new forks cannot be made from ``ref`` on this host (its memory was saved by another QEMU build), or
        None. Its existing forks still wake from it (cold, their files kept, when their memory cannot load)."""
        outdated = getattr(self.driver, "template_outdated", None)
        return outdated(ref) if callable(outdated) else None

    async def ensure(self, deployment: Deployment, on_progress: Any = None, record: Any = None) -> TemplateRef:
        """The deployment's template, built now if this host has none (single-flight per deployment). ``record``
        takes a span for each request the build's package installs make (the deploy's trace)."""
        async with self._deployment_lock(deployment.id):
            ref = self.cached(deployment.id)
            if ref is not None and self.published is not None:
                ref = await self._still_chosen(deployment, ref)
            if ref is not None:
                return ref
            if self.published is not None:
                ref = await self._fetch_published(deployment)
                if ref is not None:
                    return ref
            return await self._build(deployment, on_progress, record)

    @contextlib.asynccontextmanager
    async def _deployment_lock(self, deployment_id: str) -> AsyncIterator[None]:
        """Single flight per deployment (a build, a fetch, the collection of its template). The lock exists while
        someone holds or waits on it; the last one out drops it."""
        lock = self._locks.setdefault(deployment_id, asyncio.Lock())
        self._lock_users[deployment_id] = self._lock_users.get(deployment_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            left = self._lock_users[deployment_id] - 1
            if left:
                self._lock_users[deployment_id] = left
            else:
                del self._lock_users[deployment_id]
                del self._locks[deployment_id]

    async def _still_chosen(self, deployment: Deployment, ref: TemplateRef) -> TemplateRef | None:
        """Fleet: the cached template while the deployment's claim names it; the claimed one when another is
        claimed (and fetchable); None when the claim is gone (the collector retired the template: build anew)."""
        hit = self._claim_checked.get(deployment.id)
        if hit is not None and hit[0] == ref.id and time.monotonic() - hit[1] < self.claim_ttl_s:
            return ref
        try:
            claim = await asyncio.to_thread(self.published.chosen, deployment.id)
        except Exception as e:  # noqa: BLE001 - the object store is out of reach: what this host has will do
            log.warning("could not check the published template; using this host's", deployment=deployment.id,
                        error=str(e))
            return ref
        if claim is not None and str(claim.get("template_id")) == ref.id:
            self._claim_checked[deployment.id] = (ref.id, time.monotonic())
            return ref
        self._claim_checked.pop(deployment.id, None)
        if claim is not None:
            # Another host's claim won (or ours could not be fetched when we built): theirs when it can be had.
            theirs = await self._fetch_published(deployment, claim)
            if theirs is None or theirs.id == ref.id:
                if theirs is None and self._outdated_claims.get(deployment.id) == str(claim.get("template_id")):
                    # Claimed by a host on another QEMU build (a rolling upgrade): ours serves this host.
                    self._claim_checked[deployment.id] = (ref.id, time.monotonic())
                return theirs or ref
            await self._drop(ref)
            return theirs
        log.info("this host's template of the deployment was retired; making it again", deployment=deployment.id,
                 template=ref.id)
        self._meta(deployment.id).unlink(missing_ok=True)
        await self._drop(ref)
        return None

    async def _drop(self, ref: TemplateRef) -> None:
        """Delete this host's copy of a template (a micro-VM template's files stay while a fork here maps them)."""
        if ref.driver != self.driver.name:
            return
        with contextlib.suppress(MoorageError, OSError):
            await self.driver.delete_template(ref)

    async def _fetch_published(self, deployment: Deployment, claim: dict[str, Any] | None = None, *,
                               then: str = "building one on this host") -> TemplateRef | None:
        """The deployment's published template, fetched to this host (None: none published, or it is unusable;
        ``then`` says in the log what the caller does instead)."""
        try:
            claim = claim or await asyncio.to_thread(self.published.chosen, deployment.id)
            if claim is None:
                return None
            path = await asyncio.to_thread(self.published.fetch, str(claim["template_id"]))
        except (MoorageError, OSError, ValueError, KeyError) as e:
            log.error(f"published template unusable; {then}", deployment=deployment.id, error=str(e))
            return None
        ref = self.published.ref_of(claim, path)
        why = self._outdated(ref)
        if why is not None:
            # Its forks still wake here from it; new forks need a template this host's QEMU can load.
            self._outdated_claims[deployment.id] = ref.id
            log.warning(f"the published template cannot be forked on this host; {then}", deployment=deployment.id,
                        template=ref.id, reason=why)
            return None
        record = _ref_json(ref)
        try:  # the cache entries its instances here may fetch: kept while the record is (_collect_package_cache)
            record[PACKAGE_CACHE] = await asyncio.to_thread(self.published.packages_published, ref.id)
        except (MoorageError, OSError) as e:  # named nothing: this host's cache is not collected while it stays
            log.warning("could not list a fetched template's packages", template=ref.id, error=str(e))
        write_private(self._meta(deployment.id), json.dumps(record).encode())
        return ref

    async def prefetch(self, deployment: Deployment) -> TemplateRef | None:
        """Fleet: fetch the deployment's published template before anything here needs it (``fleet/prefetch.py``),
        so the first wake of one of its instances on this host does not wait for the object store. Never builds.
        Returns what was fetched; None when this host already has it, or nothing (usable) is published yet."""
        if self.published is None:
            return None
        async with self._deployment_lock(deployment.id):
            if self.cached(deployment.id) is not None:
                return None
            return await self._fetch_published(deployment, then="its first wake here fetches it")

    async def _build(self, deployment: Deployment, on_progress: Any, record: Any = None) -> TemplateRef:
        def say(msg: str) -> None:
            log.info(msg, deployment=deployment.id)
            if on_progress:
                on_progress(msg)

        builder_id = f"tpl-{deployment.id[:24]}"
        if builder_id in await self.driver.list():
            await (await self.driver.open(builder_id)).destroy()
        # The template's size is the agent's (every fork inherits it); a size this host cannot give fails here,
        # before anything boots, and the deploy with it.
        spec = spec_for(deployment.manifest, self.driver.config, self.driver.root)
        archive = self.archive(deployment)
        requirements = deploy_packages.requirements_of(unpack(archive))
        apt = deploy_apt.packages_of(deployment.manifest)
        spec = dataclasses.replace(spec, env=boot_env(deployment.manifest, requirements))
        say(f"starting a sandbox for the template ({spec.memory_mib} MiB, {spec.vcpus} vCPU, {spec.disk_mib} MiB disk)")
        sb = await self.booted.start_builder(builder_id, spec, say)
        # The installed packages in this host's cache, published with the template for a driver whose forks own
        # their files (instance_update installs a redeploy's into them; shared ones are bound from the template).
        entries: list[tuple[str, str, Path]] = []
        #: The package cache's entries the build installed from: kept while this host keeps the template's record.
        used: set[str] = set()

        def kept(kind: str) -> Callable[[str, Path], None]:
            def keep(key: str, path: Path) -> None:
                used.add(path.name)
                if not self.driver.capabilities.shares_template_dirs:
                    entries.append((kind, key, path))
            return keep

        try:
            if apt:
                await deploy_apt.install(sb, apt, self.driver.config, self._egress(), self.root / "package-cache",
                                         say, owner=deployment.agent_id, record=record, kept=kept("apt"))
            if requirements:
                await self.install_packages(sb, requirements, deployment.agent_id, say, record=record,
                                            kept=kept("site"))
                await sb.channel.call("packages.refresh", {}, timeout=30)
            say("loading the agent's code")
            await push_and_load(sb, deployment, archive)
            say("snapshotting the template")
            # Unique per build: two hosts never hold different templates under one id (the fleet ships by id).
            # The packages are the same for every fork: a driver that copies files shares them instead.
            ref = await self.driver.make_template(sb, f"dep-{deployment.id[:24]}-{uuid.uuid4().hex[:6]}",
                                                  shared=[deploy_packages.SITE_DIR] if requirements else [],
                                                  standalone=True)
        finally:
            await sb.destroy()
        if self.published is not None:
            say("publishing the template")
            for kind, key, path in entries:  # first: a host that forks the template may need them
                await asyncio.to_thread(self.published.publish_packages, ref.id, key, path, kind)
            claim = await asyncio.to_thread(self.published.publish, ref, deployment.id,
                                            replacing=self._outdated_claims.get(deployment.id))
            if claim["template_id"] != ref.id:
                # Another host published first: forks everywhere use that one. Ours is deleted here and in the
                # object store (no fork was made from it); if theirs cannot be fetched, ours stays and is used.
                theirs = await self._fetch_published(deployment, claim)
                if theirs is not None:
                    await self.driver.delete_template(ref)
                    await asyncio.to_thread(self.published.unpublish, ref.id)
                    say("template ready (another host's)")
                    return theirs
        write_private(self._meta(deployment.id), json.dumps({**_ref_json(ref), PACKAGE_CACHE: sorted(used)}).encode())
        say("template ready")
        return ref

    async def drop_builders(self, building: Iterable[str] = ()) -> list[str]:
        """Destroy the builder sandboxes (``tpl-<deployment id, 24>``, see ``_build``) a crash left on this host: a
        build cut short never finishes, and its sandbox (its disk, and on the process driver its processes running
        the agent's code) stayed for ever. Those of deployments in ``building`` (still built by a live host) and of
        builds of this process stay. Returns the ids destroyed."""
        gone = []
        for sid in await self.driver.list():
            prefix = sid[len("tpl-"):]
            if not sid.startswith("tpl-") or any(d.startswith(prefix) for d in building) or any(
                    d.startswith(prefix) and lock.locked() for d, lock in self._locks.items()):
                continue
            try:
                await (await self.driver.open(sid)).destroy()
            except Exception as e:  # noqa: BLE001 - tried again at the next start
                log.warning("could not remove the sandbox of a build cut short", sandbox=sid, error=str(e))
                continue
            log.info("removed the sandbox of a build cut short", sandbox=sid)
            gone.append(sid)
        return gone

    @contextlib.contextmanager
    def fork_template(self) -> Iterator[str]:
        """A new id for a time-travel fork's template (``tt-<16 hex>``), held as in progress for the block: the
        collection leaves it alone meanwhile, and takes one a crash left behind (``_abandoned``)."""
        tid = f"tt-{uuid.uuid4().hex[:16]}"
        self._forking.add(tid)
        try:
            yield tid
        finally:
            self._forking.discard(tid)

    # -- fork templates: snapshots of one user's instance, so that user's data. Earlier versions' sandbox `fork`
    # verb made them (``forks/<template>.json`` names the user); it now forks into new users through the timeline,
    # and what those left on a host still goes with its user's ``forget`` or with the collection below.

    def _forks_dir(self) -> Path:
        return private_dir(self.root / "forks")

    def forks_of(self, tenant_id: str, agent: str, user: str) -> list[tuple[Path, TemplateRef]]:
        """The fork templates on this host made from ``user``'s instances of ``agent`` in one tenant."""
        out = []
        for p in sorted(self._forks_dir().glob("*.json")):
            try:
                d = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if (d.get("tenant_id"), d.get("agent"), d.get("user")) == (tenant_id, agent, user):
                out.append((p, _ref_of(d["template"], self._templates_dir())))
        return out

    async def delete_forks(self, tenant_id: str, agent: str, user: str) -> int:
        """Delete every fork template of ``user`` on this host (the record last, so a crash can be retried)."""
        forks = self.forks_of(tenant_id, agent, user)
        for record, ref in forks:
            if ref.driver == self.driver.name:
                await self.driver.delete_template(ref)
            else:
                log.warning("fork template of another driver left on disk", template=ref.id, driver=ref.driver)
            record.unlink(missing_ok=True)
        return len(forks)

    # -- collection: templates nobody needs any more --------------------------------------------------

    def _templates_dir(self) -> Path:
        fn = getattr(self.driver, "template_dir", None)
        return fn("x").parent if callable(fn) else Path(self.driver.root) / ".templates"

    def collect_soon(self) -> None:
        """After a deploy or rollback: let the collector look at the template that stopped being live."""
        if self.gc is not None:
            self.gc.soon()

    async def collect(self, use: "TemplateUse", *, grace_s: float, now: float | None = None,
                      pins: Callable[[str], bool] | None = None) -> int:
        """Delete this host's templates that ``use`` (read from the store) says nobody needs: those of deployments
        neither live nor fresh, fork templates whose user has no instance left (forgotten, or deleted by its TTL),
        and templates fetched for instances none of which names them any more (templates made here are their
        maker's to delete). Anything younger than ``grace_s`` stays (a build or fetch in progress). Then the package
        files no deployment names (``PackageFiles.collect``). Returns how many templates went."""
        from moorage.fleet.gc import forks_need_template, template_shares

        now = time.time() if now is None else now
        pins = pins or forks_need_template
        removed = 0
        named: set[str] = set()
        for meta in sorted(self.root.glob("*.json")):
            dep = meta.stem
            try:
                ref = _ref_of(json.loads(meta.read_text()), self._templates_dir())
                age = now - meta.stat().st_mtime
            except (OSError, ValueError, KeyError):
                continue
            if dep in use.deployments or age < grace_s:
                named.add(ref.id)
                continue
            # Under the deployment's lock: an ensure() of it (a rollback) waits, then builds or fetches anew.
            async with self._deployment_lock(dep):
                meta.unlink(missing_ok=True)
                if self.on_retired is not None:
                    await self.on_retired(ref.id)  # its pooled forks first: they map its files
                await self._drop(ref)
            removed += 1
            log.info("template of a replaced deployment deleted from this host", deployment=dep, template=ref.id)
        for record in sorted(self._forks_dir().glob("*.json")):
            try:
                d = json.loads(record.read_text())
                ref = _ref_of(d["template"], self._templates_dir())
                age = now - record.stat().st_mtime
            except (OSError, ValueError, KeyError):
                continue
            if (d.get("tenant_id"), d.get("agent"), d.get("user")) in use.users or age < grace_s:
                named.add(ref.id)
                continue
            await self._drop(ref)
            record.unlink(missing_ok=True)
            removed += 1
            log.info("fork template of a user without instances deleted", template=ref.id, agent=d.get("agent"))
        tdir = self._templates_dir()
        for path in sorted(tdir.iterdir()) if tdir.is_dir() else ():
            tid = path.name
            if tid.startswith(".") or tid.endswith((".new", ".old")) or tid in named or not path.is_dir():
                continue
            if not (path / "template.json").exists():
                continue
            if not (path / ".fetched").exists() and not (path / "deleted").exists() and not self._abandoned(tid, use):
                # Made on this host (a build or fork in progress, a time-travel fork's): whoever made it deletes
                # it; only copies fetched from the object store, ones the driver already marked deleted (kept for
                # forks that may be gone), and builds a crash abandoned are this collection's to delete.
                continue
            if tid in use.pinned and pins(self.driver.name, template_shares(path)):
                continue  # an instance's fork needs it (fetched here for its wake, or made here)
            try:
                age = now - max((path / n).stat().st_mtime for n in ("template.json", ".fetched", "deleted")
                                if (path / n).exists())
            except (OSError, ValueError):
                continue
            if age < grace_s:
                continue
            self._prune_children(path)
            if (path / "deleted").exists() and (path / "children").is_dir() and any((path / "children").iterdir()):
                continue  # already deleted here; a fork on this host still maps it
            await self._drop(TemplateRef(tid, self.driver.name, path, None, 0.0, False))
            if not path.exists():
                removed += 1
                log.info("template nobody names deleted from this host", template=tid)
        self._collect_package_cache(now, grace_s)
        self.package_files.collect(use.packages, read_at=use.read_at, grace_s=grace_s, now=now)
        return removed

    def _collect_package_cache(self, now: float, grace_s: float) -> int:
        """Delete the installed packages (``package-cache/``: a tarball per requirements.txt or apt list an agent
        was deployed with, tens of MiB) that no template record still on this host names and nothing wrote for
        ``grace_s``: without this every change of an agent's packages left one for good. A rollback to a
        deployment whose entry went installs its packages again. Nothing goes while a template is being made
        here, or while a record does not say what it names (``PACKAGE_CACHE``). Returns how many went."""
        cache = self.root / "package-cache"
        if not cache.is_dir() or any(lock.locked() for lock in list(self._locks.values())):
            return 0
        named: set[str] = set()
        for meta in self.root.glob("*.json"):
            try:
                names = json.loads(meta.read_text()).get(PACKAGE_CACHE)
            except (OSError, ValueError, AttributeError):
                return 0
            if not isinstance(names, list):
                return 0
            named.update(str(n) for n in names)
        removed = 0
        for entry in sorted(cache.iterdir()):
            try:
                if entry.name in named or not entry.is_file() or now - entry.stat().st_mtime < grace_s:
                    continue
                entry.unlink()
            except OSError:
                continue
            removed += 1
            log.info("installed packages no deployment here uses deleted from the cache", entry=entry.name)
        return removed

    def _abandoned(self, template_id: str, use: "TemplateUse") -> bool:
        """Whether ``template_id`` is a deployment build (``dep-<deployment id, 24>-<hex>``) no ensure() of this
        process is making and whose deployment the store no longer needs (a deploy a crash cut short), or a
        time-travel fork's template (``tt-<16 hex>``) no fork of this process is using (a fork a crash cut short:
        its forks, if a micro-VM's need it, still pin it), or a booted template (``boot-...``) no record names (a
        crash between its making and its record; a builder forked from it keeps its files until it is gone)."""
        if template_id.startswith("tt-") and len(template_id) == 19:
            return template_id not in self._forking
        if template_id.startswith(booted.PREFIX):
            return template_id not in self.booted.names()
        parts = template_id.split("-")
        if len(parts) != 3 or parts[0] != "dep" or len(parts[2]) != 6:
            return False
        prefix = parts[1]
        if any(d.startswith(prefix) for d in use.deployments):
            return False
        return not any(dep.startswith(prefix) and lock.locked() for dep, lock in self._locks.items())

    def _prune_children(self, tdir: Path) -> None:
        """A micro-VM template keeps its files while ``children/<sandbox>`` entries name forks on this host; a
        fork whose directory is gone (evicted from a fleet host's cache, removed by hand) no longer holds it."""
        children = tdir / "children"
        if not children.is_dir():
            return
        for child in list(children.iterdir()):
            if not (Path(self.driver.root) / child.name).exists():
                child.unlink(missing_ok=True)
