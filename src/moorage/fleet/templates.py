"""Deployment templates (and the guest images under them) in the object store, so every host forks the same one.

An instance's RAM delta and disk overlay are only valid against the very template, and guest image, it was forked
from; a host that lacks a template therefore fetches the published one instead of building its own.

Layout: ``templates/<template id>/`` is the template directory shipped like an instance (``Shipper``, manifest
``snapshots/template.json``); ``deployments/<deployment id>/template.json`` names the template new forks of that
deployment use (written if-absent: the first host to publish wins, a host that loses the race uses the winner's);
``images/<sha256>/`` holds the guest image files a micro-VM template's disk is an overlay on, by the digest of their
bytes, so a host whose own image of that id differs fetches the right bytes.

Templates and images nobody needs any more are removed by ``fleet/gc.py`` in two steps; a ``retired.json`` marker
in their prefix says so. A template whose marker says ``deleting`` is refused by ``fetch`` (never half a template).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from moorage.errors import MoorageError
from moorage.fsync import fsync_dir
from moorage.fleet.ship import Shipper, SnapshotUnavailable
from moorage.log import get_logger
from moorage.objects import ObjectExists, ObjectNotFound, ObjectStore, sha256_file
from moorage.sandbox import SnapshotIncompatible, TemplateRef
from moorage.sandbox.base import validate_id
from moorage.sandbox.image import GuestImage

log = get_logger(__name__)

#: The manifest name of a published template (``templates/<id>/snapshots/template.json``).
MANIFEST = "template"
#: In a template directory fetched from the object store (never published itself: a dot-name, host bookkeeping).
FETCHED = ".fetched"
_IMAGE_FILES = ("kernel", "initrd", "rootfs")
#: A package cache entry's key (``runtime/deploy_packages``): a sha256.
_CACHE_KEY = re.compile(r"[0-9a-f]{64}")
#: One fetch of a template or image at a time per local path, across every publisher object of the process.
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock(path: Path) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(str(path), threading.Lock())


def _flatten_onto(disk: Path, rootfs: Path) -> None:
    """Make the qcow2 ``disk`` an overlay directly on the raw ``rootfs`` without changing what it reads (a safe
    rebase copies in what its present backing chain adds). Nothing may have it open. Blocking."""
    info = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(disk)], capture_output=True, text=True)
    if info.returncode != 0:
        raise SnapshotIncompatible(f"qemu-img info of {disk} failed: {info.stderr.strip()}")
    if json.loads(info.stdout).get("backing-filename") == str(rootfs):
        return
    mode = disk.stat().st_mode & 0o777
    disk.chmod(mode | 0o200)
    try:
        r = subprocess.run(["qemu-img", "rebase", "-q", "-f", "qcow2", "-b", str(rootfs), "-F", "raw", str(disk)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SnapshotIncompatible(f"could not make {disk} an overlay on its guest image: {r.stderr.strip()}",
                                       hint="the fork still works on this host; its forks wake only here")
        _fsync_file(disk)
    finally:
        disk.chmod(mode)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_portable(rel: str) -> bool:
    # A template directory without a driver filter (the process driver's): all but this host's bookkeeping.
    return not rel.startswith(".") and rel.split("/", 1)[0] not in ("children", "deleted")


class PublishedTemplates:
    """Publishes this host's deployment templates and fetches other hosts' into the driver's templates directory."""

    def __init__(self, objects: ObjectStore, driver: Any) -> None:
        self.objects = objects
        self.driver = driver
        self.shipper = Shipper(objects)
        self.root = Path(driver.root)

    # -- keys and places ------------------------------------------------------------------------------

    @staticmethod
    def prefix(template_id: str) -> str:
        return f"templates/{validate_id(template_id, 'template id')}"

    @staticmethod
    def marker_key(deployment_id: str) -> str:
        return f"deployments/{deployment_id}/template.json"

    @staticmethod
    def image_prefix(digest: str) -> str:
        return f"images/{digest}"

    def local_dir(self, template_id: str) -> Path:
        fn = getattr(self.driver, "template_dir", None)
        return fn(template_id) if callable(fn) else self.root / ".templates" / validate_id(template_id, "template id")

    def _portable(self) -> Any:
        fn = getattr(self.driver, "template_portable", None)
        return fn if callable(fn) else _default_portable

    # -- guest images ---------------------------------------------------------------------------------

    def _file_sha256(self, path: Path) -> str:
        """sha256 of a (large, read-only) image file, remembered by inode, size and mtime in the driver root."""
        cache_path = self.root / ".image-digests.json"
        st = path.stat()
        sig = [st.st_ino, st.st_size, st.st_mtime_ns]
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, ValueError):
            cache = {}
        hit = cache.get(str(path))
        if isinstance(hit, dict) and hit.get("sig") == sig:
            return str(hit["sha256"])
        digest = sha256_file(path)
        with _lock(cache_path):
            try:
                cache = json.loads(cache_path.read_text())
            except (OSError, ValueError):
                cache = {}
            cache[str(path)] = {"sig": sig, "sha256": digest}
            tmp = cache_path.with_name(f"{cache_path.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_path)
        return digest

    def image_files(self, image: GuestImage) -> dict[str, str]:
        return {k: self._file_sha256(Path(getattr(image, k))) for k in _IMAGE_FILES}

    @staticmethod
    def _digest_of(files: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()

    def image_digest(self, image: GuestImage) -> str:
        """The digest of an image's bytes (kernel, initrd, root filesystem): equal digests, same guest."""
        return self._digest_of(self.image_files(image))

    def warm(self) -> None:
        """Learn this host's own guest image digest now (seconds of reading for a 300 MB image), so the first
        template fetched later does not wait for it. Blocking; a host without a built image does nothing."""
        images_dir = getattr(self.driver, "images_dir", None)
        if images_dir is None or not callable(getattr(self.driver, "template_image_dir", None)):
            return
        from moorage.sandbox.image import ImageBuilder

        try:
            img = ImageBuilder(Path(images_dir)).cached()
            if img is not None:
                self.image_digest(img)
        except Exception as e:  # only a head start: the fetch computes it anyway
            log.warning("could not read this host's guest image digest ahead of time", error=str(e))

    def publish_image(self, image: GuestImage) -> dict[str, Any]:
        """Store the image's files under ``images/<digest>/`` unless they are there; returns its record."""
        files = self.image_files(image)
        digest = self._digest_of(files)
        prefix = self.image_prefix(digest)
        record = {"id": image.id, "digest": digest, "files": files,
                  "names": {k: Path(getattr(image, k)).name for k in _IMAGE_FILES},
                  "manifest": {k: v for k, v in image.to_json().items() if k not in ("dir", *_IMAGE_FILES)}}
        if not self.objects.exists(f"{prefix}/image.json"):
            for k in _IMAGE_FILES:
                key = f"{prefix}/{record['names'][k]}"
                if not self.objects.exists(key):
                    with contextlib.suppress(ObjectExists):
                        self.objects.put_file(key, Path(getattr(image, k)), sha256=files[k])
            # Written last: an image.json means every file is there.
            self.objects.put_bytes(f"{prefix}/image.json", json.dumps(record).encode())
            log.info("guest image published", image=image.id, digest=digest[:16])
        return {"id": image.id, "digest": digest}

    def _keep_image(self, image: GuestImage, wait_s: float = 120.0) -> None:
        """After a template naming ``image`` was published: undo a collection's retirement of the image, or, if
        it is being deleted, wait for that to finish and publish the image again. Blocking."""
        from moorage.fleet.gc import MARKER

        prefix = self.image_prefix(self.image_digest(image))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                marker = json.loads(self.objects.get_bytes(f"{prefix}/{MARKER}"))
            except ObjectNotFound:
                marker = None
            except ValueError:
                marker = {"state": "deleting"}
            if marker is None:
                break
            if marker.get("state") == "retired":
                with contextlib.suppress(ObjectNotFound):
                    self.objects.delete(f"{prefix}/{MARKER}")
                break
            if time.monotonic() > deadline:
                raise MoorageError(f"guest image {prefix} stayed marked for deletion for {wait_s:.0f} s",
                                   hint="check the object store; publishing the template again retries")
            time.sleep(0.5)
        if not self.objects.exists(f"{prefix}/image.json"):
            self.publish_image(image)

    def local_image(self, wanted: dict[str, Any]) -> GuestImage:
        """This host's copy of the image ``{"id", "digest"}``: its own build when the bytes match, else fetched by
        digest into ``<driver root>/.images/`` (once). Blocking."""
        images_dir = getattr(self.driver, "images_dir", None)
        own = Path(images_dir) / str(wanted["id"]) if images_dir else None
        if own is not None and (own / "manifest.json").exists():
            img = GuestImage.load(own)
            if self.image_digest(img) == wanted["digest"]:
                return img
            log.info("this host's guest image differs from the template's; fetching the template's",
                     image=wanted["id"], digest=str(wanted["digest"])[:16])
        digest = str(wanted["digest"])
        dest = self.root / ".images" / digest[:32]
        with _lock(dest):
            if (dest / "manifest.json").exists():
                return GuestImage.load(dest)
            prefix = self.image_prefix(digest)
            try:
                record = json.loads(self.objects.get_bytes(f"{prefix}/image.json"))
            except ObjectNotFound as e:
                raise SnapshotUnavailable(f"guest image {digest[:16]} of a published template is not in the object store",
                                          hint="publish the template again from a host that has the image") from e
            if self._digest_of(record["files"]) != digest:
                raise SnapshotUnavailable(f"guest image record {prefix}/image.json does not match its digest")
            tmp = dest.with_name(f".fetch-{dest.name}-{uuid.uuid4().hex[:8]}")
            tmp.mkdir(parents=True)
            try:
                manifest = dict(record["manifest"], dir=str(dest))
                for k in _IMAGE_FILES:
                    name = validate_id(str(record["names"][k]), "image file name")
                    # Verified against the digest while it streams; damage raises ObjectCorrupt.
                    self.objects.get_file(f"{prefix}/{name}", tmp / name, sha256=record["files"][k])
                    (tmp / name).chmod(0o444)
                    manifest[k] = str(dest / name)
                (tmp / "manifest.json").write_text(json.dumps(manifest))
                os.rename(tmp, dest)
                fsync_dir(dest.parent)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("guest image fetched", image=wanted["id"], digest=digest[:16])
            return GuestImage.load(dest)

    # -- templates ------------------------------------------------------------------------------------

    def chosen(self, deployment_id: str) -> dict[str, Any] | None:
        """The published template new forks of the deployment use, or None when no host published one."""
        try:
            return json.loads(self.objects.get_bytes(self.marker_key(deployment_id)))
        except ObjectNotFound:
            return None

    def publish(self, ref: TemplateRef, deployment_id: str, *, replacing: str | None = None) -> dict[str, Any]:
        """Ship the template (and its image), then claim the deployment for it; returns the winning claim (ours,
        or another host's that got there first; ours stays fetchable by id either way). ``replacing``: a claimed
        template this host cannot fork (saved by another QEMU build); while the claim still names it, ours replaces
        it, so hosts of the new build stop building their own. Blocking."""
        tdir = Path(ref.path)
        image = None
        image_dir_of = getattr(self.driver, "template_image_dir", None)
        if callable(image_dir_of):
            image = self.publish_image(GuestImage.load(image_dir_of(tdir)))
        from moorage.fleet.gc import template_shares

        meta = {"driver": ref.driver, "template_id": ref.id, "deployment_id": deployment_id, "image": image,
                "source_sandbox": ref.source_sandbox, "created_at": ref.created_at,
                "includes_memory": ref.includes_memory, "shared": template_shares(tdir)}
        rep = self.shipper.push(tdir, self.prefix(ref.id), MANIFEST, include=self._portable(), meta=meta)
        if image is not None and image_dir_of is not None:
            # Checked after the template names its image: a collection deleting that image meanwhile either
            # sees this template (and keeps the image) or is seen here (and the image is published again).
            self._keep_image(GuestImage.load(image_dir_of(tdir)))
        log.info("template published", template=ref.id, deployment=deployment_id, bytes=rep.bytes_moved,
                 ms=round(rep.seconds * 1000, 1))
        claim = json.dumps({**meta, "published_at": time.time()}).encode()
        key = self.marker_key(deployment_id)
        stale = self.chosen(deployment_id) if replacing is not None else None
        if stale is not None and str(stale.get("template_id")) == replacing:
            # Not conditional: two hosts of the new build racing both write, the last one wins and the other
            # fetches it on its next claim check (each template stays published, so every fork wakes anywhere).
            self.objects.put_bytes(key, claim)
            log.warning("the deployment's claimed template cannot be forked by this host's QEMU; claimed ours",
                        deployment=deployment_id, template=ref.id, replaced=replacing)
        elif self.objects.supports_if_absent:
            with contextlib.suppress(ObjectExists):
                self.objects.put_bytes(key, claim, if_absent=True)
        elif not self.objects.exists(key):
            # Without conditional writes two hosts racing may both write; each template is published, so every
            # instance wakes anywhere, and new forks follow whichever claim is read.
            self.objects.put_bytes(key, claim)
        winner = self.chosen(deployment_id)
        if winner is None:
            raise MoorageError(f"the template claim of deployment {deployment_id} vanished after it was written",
                               hint="check the object store")
        return winner

    def publish_fork(self, ref: TemplateRef, owner: dict[str, str]) -> bool:
        """Publish a fork template (a snapshot of one user's instance that new end-users are forked from: time
        travel) so those forks wake on any host. No claim: no deployment forks it; the collector keeps it while an
        instance names it. Only for templates whose forks need them (a process fork is a copy but for the
        template's shared directories: ``forks_need_template``); returns whether it was published. Blocking.

        A micro-VM fork template's disk is a copy of the instance's overlay, itself on its deployment template's
        disk; it is first made an overlay on the guest image itself (same contents, the deployment template's
        changes copied in), as every published template's is, before any fork is made from it."""
        from moorage.fleet.gc import forks_need_template, template_shares

        tdir = Path(ref.path)
        if not forks_need_template(ref.driver, template_shares(tdir)):
            return False
        image = None
        img: GuestImage | None = None
        image_dir_of = getattr(self.driver, "template_image_dir", None)
        if callable(image_dir_of):
            img = GuestImage.load(image_dir_of(tdir))
            _flatten_onto(tdir / "disk.qcow2", img.rootfs)
            image = self.publish_image(img)
        meta = {"driver": ref.driver, "template_id": ref.id, "deployment_id": None, "image": image,
                "source_sandbox": ref.source_sandbox, "created_at": ref.created_at,
                "includes_memory": ref.includes_memory, "fork_of": owner, "shared": template_shares(tdir)}
        rep = self.shipper.push(tdir, self.prefix(ref.id), MANIFEST, include=self._portable(), meta=meta)
        if img is not None:
            self._keep_image(img)
        log.info("fork template published", template=ref.id, bytes=rep.bytes_moved, ms=round(rep.seconds * 1000, 1))
        return True

    def fetch(self, template_id: str) -> Path:
        """Make the published template ``template_id`` this host's (pulled into the driver's templates directory
        and adopted: paths, disk backing, image); returns its directory. Blocking, single-flight per template."""
        final = self.local_dir(template_id)
        with _lock(final):
            if (final / "template.json").exists():
                return final
            prefix = self.prefix(template_id)
            self._refuse_deleting(template_id)
            key = self.shipper.manifest_key(prefix, MANIFEST)
            meta = self.shipper.read_manifest(key).get("meta") or {}
            if meta.get("driver") != self.driver.name:
                raise SnapshotIncompatible(f"published template {template_id} was made by the {meta.get('driver')} "
                                           f"driver, this host runs {self.driver.name}",
                                           hint="run every host of a fleet on the same sandbox driver")
            image = self.local_image(meta["image"]) if meta.get("image") else None
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = final.with_name(f".fetch-{final.name}-{uuid.uuid4().hex[:8]}")
            started = time.monotonic()
            try:
                rep = self.shipper.pull(key, prefix, staging)
                self._refuse_deleting(template_id)  # the collection began while we copied: not a whole template
                if image is not None:
                    self.driver.adopt_template(staging, final, image)
                # This host's collection may delete a fetched copy once nothing names it (the bucket has it).
                (staging / FETCHED).write_text(str(time.time()))
                os.rename(staging, final)
                fsync_dir(final.parent)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            log.info("template fetched", template=template_id, bytes=rep.bytes_moved,
                     ms=round((time.monotonic() - started) * 1000, 1))
            return final

    def _refuse_deleting(self, template_id: str) -> None:
        from moorage.fleet.gc import MARKER

        try:
            marker = json.loads(self.objects.get_bytes(f"{self.prefix(template_id)}/{MARKER}"))
        except ObjectNotFound:
            return
        except ValueError:
            marker = {"state": "deleting"}
        if marker.get("state") == "deleting":
            raise SnapshotUnavailable(f"published template {template_id} is being deleted (no instance needs it)",
                                      hint="the next request provisions from the agent's live template")

    # -- deploy-time packages ---------------------------------------------------------------------------

    def packages_key(self, template_id: str, key: str, kind: str = "site") -> str:
        """Where a template's installed ``requirements.txt`` tree (``runtime/deploy_packages``' cache entry ``key``;
        ``kind`` "apt": the .deb files of its ``[agent] apt`` list, ``runtime/deploy_apt``'s) is published: under
        the template, so it goes with it."""
        if not _CACHE_KEY.fullmatch(key) or kind not in ("site", "apt"):
            raise ValueError(f"not a package cache key: {kind} {key!r}")
        return f"{self.prefix(template_id)}/packages/{key}.tar.gz" if kind == "site" else \
            f"{self.prefix(template_id)}/packages/apt-{key}.tar"

    def publish_packages(self, template_id: str, key: str, path: Path, kind: str = "site") -> None:
        """Publish the packages the template's builder installed, for instances of the deployment on hosts that did
        not build it (a redeploy's packages put into an instance's own disk: ``runtime/instance_update``).
        Blocking."""
        self.objects.put_file(self.packages_key(template_id, key, kind), path)

    def fetch_packages(self, template_id: str, key: str, dest: Path, kind: str = "site") -> bool:
        """This template's published packages ``key`` into ``dest`` (atomically, verified); False if there are
        none."""
        try:
            self.objects.get_file(self.packages_key(template_id, key, kind), dest)
        except ObjectNotFound:
            return False
        return True

    def packages_published(self, template_id: str) -> list[str]:
        """The package cache entries (their names in ``package-cache/``: ``<key>.tar.gz``, ``apt-<key>.tar``)
        published beside the template: those an instance of its deployment on a host that fetched it may bring into
        that host's cache. Blocking."""
        return sorted(o.key.rsplit("/", 1)[1] for o in self.objects.iter(f"{self.prefix(template_id)}/packages/"))

    def unpublish(self, template_id: str) -> int:
        """Remove a published template's objects (one no instance was forked from). Blocking."""
        return self.objects.delete_prefix(self.prefix(template_id) + "/")

    def ref_of(self, claim: dict[str, Any], path: Path) -> TemplateRef:
        return TemplateRef(str(claim["template_id"]), str(claim["driver"]), path, claim.get("source_sandbox"),
                           float(claim.get("created_at") or 0.0), bool(claim.get("includes_memory")))
