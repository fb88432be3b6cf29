"""What of a micro-VM sandbox or template travels between the hosts of a fleet, and making a fetched copy this
host's: its disk's backing file, its metadata's paths and template, no process of the other host."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from moorage.sandbox.base import SandboxError, SandboxState, SnapshotCorrupt, SnapshotIncompatible
from moorage.sandbox.image import GuestImage
from moorage.sandbox.microvm_files import qcow2_backing, rebase, write_json
from moorage.sandbox.microvm_templates import CHILD_DISK

if TYPE_CHECKING:
    from moorage.sandbox.microvm import MicroVMDriver

#: A sandbox directory's sleeping state on any host. Sockets (run/), pids, logs and half-written snapshot
#: directories (*.new, *.old) are this host's only.
PORTABLE = frozenset({"meta.json", "disk.qcow2", "ram", "snapshot", "checkpoints"})
#: A template directory's state on any host. ``children/`` and ``deleted`` are this host's bookkeeping and the
#: child overlay is remade against this host's path (``adopt_template``).
TEMPLATE_PORTABLE = frozenset({"template.json", "dev.state", "ram", "disk.qcow2"})


def adopt_template(staging: Path, final: Path, image: GuestImage) -> None:
    """A template fetched into ``staging`` (renamed to ``final`` by the caller) made this host's: its disk
    backed by ``image`` (the same bytes as where it was made, checked by the caller), its metadata naming this
    host's image, and a child overlay for forks on ``final``'s disk. Blocking."""
    tmeta = json.loads((staging / "template.json").read_text())
    if tmeta.get("image_id") != image.id:
        raise SnapshotIncompatible(f"template {tmeta.get('id')} was made on image {tmeta.get('image_id')}, not {image.id}",
                                   hint="publish the template's own image with it")
    old = qcow2_backing(staging / "disk.qcow2")
    if old is None or Path(old).name != image.rootfs.name:
        # A template made from a fork's snapshot would chain onto another template: not a publishable one.
        raise SnapshotIncompatible(f"template {tmeta.get('id')} disk is not an overlay on its image ({old})",
                                   hint="publish templates made from a sandbox booted from the image")
    rebase(staging / "disk.qcow2", image.rootfs, "raw")
    child = staging / CHILD_DISK
    r = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(staging / "disk.qcow2"), "-F", "qcow2",
                        str(child)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SandboxError(f"qemu-img create of a child overlay failed: {r.stderr.strip()}")
    rebase(child, final / "disk.qcow2", "qcow2")
    (staging / "children").mkdir(exist_ok=True)
    tmeta["image_dir"] = str(image.dir)
    write_json(staging / "template.json", tmeta)


def adopt_fetched(driver: "MicroVMDriver", d: Path, sandbox_id: str) -> None:
    """A sandbox fetched into ``d`` from another host (asleep, or copied while it ran there, see ``frozen``): its
    metadata and disk now name this host's template (fetched through ``template_source`` when missing) and image,
    and no process of the other host. Idempotent. Blocking."""
    meta = json.loads((d / "meta.json").read_text())
    tid = meta.get("template_id")
    if tid:
        tdir = driver.template_dir(tid)
        why = "no template source is set"
        if not (tdir / "template.json").exists() and driver.template_source is not None:
            try:
                driver.template_source(tid)
            except SandboxError:
                raise
            except Exception as e:  # not published (a fork template), or the object store failed
                why = str(e)
        try:
            tmeta = json.loads((tdir / "template.json").read_text())
        except FileNotFoundError as e:
            raise SnapshotCorrupt(f"sandbox {sandbox_id} was forked from template {tid}, which is not on this "
                                  f"host and could not be fetched: {why}",
                                  hint="only deployment templates are published to the object store; forks of "
                                       "other templates wake on the host that made them") from e
        if tmeta.get("image_id") != meta.get("image_id"):
            raise SnapshotIncompatible(f"template {tid} here is on image {tmeta.get('image_id')}, sandbox "
                                       f"{sandbox_id} on {meta.get('image_id')}")
        if meta.get("template_dir") is not None:
            meta["template_dir"] = str(tdir)
        meta["image_dir"] = tmeta["image_dir"]
        (tdir / "children").mkdir(exist_ok=True)
        (tdir / "children" / sandbox_id).write_text("")  # keeps a deleted template's files while it lives here
        rebase(d / "disk.qcow2", tdir / "disk.qcow2", "qcow2")
    else:
        # Booted from the image itself: its disk is an overlay on this host's copy of the image by id.
        img_dir = driver.images_dir / str(meta.get("image_id"))
        if not (img_dir / "manifest.json").exists():
            raise SnapshotIncompatible(f"sandbox {sandbox_id} needs guest image {meta.get('image_id')}, not on this host",
                                       hint="build the same image on this host (`moorage image build`)")
        img = GuestImage.load(img_dir)
        meta["image_dir"] = str(img.dir)
        rebase(d / "disk.qcow2", img.rootfs, "raw")
    if meta.get("state") == SandboxState.RUNNING.value:
        # Shipped while it ran (``frozen``): its memory image of that instant, if the copy has one, is this
        # copy's snapshot; otherwise it boots from the disk it was shipped with.
        try:
            live = json.loads((d / "snapshot" / "snapshot.json").read_text())
        except (OSError, ValueError):
            live = None
        if isinstance(live, dict) and live.get("live"):
            meta.update(state=SandboxState.SLEEPING.value, snapshot=live, fresh_fork=False)
        else:
            meta.update(state=SandboxState.STOPPED.value, snapshot=None)
    meta["pid"] = None
    write_json(d / "meta.json", meta)
