"""A micro-VM root restored at another path (a data directory copied, moved or restored from a backup): the
metadata and qcow2 headers of its sandboxes and templates name the original's files; here they are made this root's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moorage.log import get_logger
from moorage.sandbox.image import GuestImage
from moorage.sandbox.microvm_files import qcow2_backing, rebase, write_json
from moorage.sandbox.microvm_templates import CHILD_DISK, TEMPLATES

if TYPE_CHECKING:
    from moorage.sandbox.microvm import MicroVMDriver

log = get_logger(__name__)


def image_dir_here(driver: "MicroVMDriver", recorded: str) -> str:
    """This root's directory of the guest image recorded at ``recorded`` (its id or digest is the directory's
    name); ``recorded`` itself when it is already this host's, or when this root has no copy of the image."""
    p = Path(recorded)
    # Compared as spelled, not resolved: an images/ that links to a cache shared with the original resolves to the
    # same place, but a path through the original's data directory breaks when that directory goes.
    if p.parent in (driver.images_dir, driver.root / ".images"):
        return recorded
    for base in (driver.images_dir, driver.root / ".images"):
        if (base / p.name / "manifest.json").exists():
            return str(base / p.name)
    return recorded


def _rebase_to(disk: Path, want: Path, fmt: str) -> None:
    """Point ``disk`` at ``want`` when its header names the same file (same name, same directory name) at
    another path: the original's. A header naming anything else is left as it is, for the wake to refuse
    (``microvm_user``): a sandbox's QEMU writes its own disk's header, so it is never a source of paths here."""
    found = qcow2_backing(disk) if disk.exists() else None
    if found is None or found == str(want):
        return
    p = Path(found)
    if (p.name, p.parent.name) == (want.name, want.parent.name):
        rebase(disk, want, fmt)


def template_here(driver: "MicroVMDriver", tdir: Path) -> None:
    """Template ``tdir`` made this root's: its record's image, its disk's backing file (an image's rootfs or
    another template's disk) and its child overlay's (this template's disk). Idempotent. Blocking."""
    try:
        tmeta: dict[str, Any] = json.loads((tdir / "template.json").read_text())
    except FileNotFoundError:
        return
    # A template's disk (root's, read-only, its header checked when it was made) is an overlay on its image's root
    # filesystem or on the disk of the template it was made from.
    found = qcow2_backing(tdir / "disk.qcow2")
    if found is not None and Path(found).parent.parent.name == TEMPLATES:
        _rebase_to(tdir / "disk.qcow2", driver.template_dir(Path(found).parent.name) / "disk.qcow2", "qcow2")
    elif found is not None:
        _rebase_to(tdir / "disk.qcow2", Path(image_dir_here(driver, str(Path(found).parent))) / Path(found).name,
                   "raw")
    child = tdir / CHILD_DISK
    if child.exists() and qcow2_backing(child) != str(tdir / "disk.qcow2"):
        rebase(child, tdir / "disk.qcow2", "qcow2")
    image = image_dir_here(driver, str(tmeta.get("image_dir")))
    if image != tmeta.get("image_dir"):
        log.info("template made this data directory's", template=tdir.name, was=tmeta.get("image_dir"))
        write_json(tdir / "template.json", {**tmeta, "image_dir": image})


def sandbox_here(driver: "MicroVMDriver", d: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Sandbox ``d`` (its ``meta``) made this root's: its template's RAM and disk, its image, its disk's backing
    file. Returns the metadata, saved when it changed. Idempotent. Blocking."""
    tid = meta.get("template_id")
    new = dict(meta)
    if tid:
        template_here(driver, driver.template_dir(tid))
        if meta.get("template_dir") is not None:  # a fork maps its template's RAM
            new["template_dir"] = str(driver.template_dir(tid))
    new["image_dir"] = image_dir_here(driver, str(meta.get("image_dir")))
    # What the host gave the sandbox (its metadata says), as microvm_user checks it before every start.
    if tid:
        _rebase_to(d / "disk.qcow2", driver.template_dir(tid) / "disk.qcow2", "qcow2")
    elif (Path(new["image_dir"]) / "manifest.json").exists():
        _rebase_to(d / "disk.qcow2", GuestImage.load(Path(new["image_dir"])).rootfs, "raw")
    if new != meta:
        log.info("sandbox made this data directory's", sandbox=d.name, template=tid)
        write_json(d / "meta.json", new)
    return new
