"""Micro-VM templates and forks: a running sandbox's RAM, device state and disk saved once under
``root/.templates/<id>``; each fork starts as that state with an empty RAM delta and an empty disk overlay.

A template's files stay while any fork maps its RAM or backs its disk on it (``children/``); a deleted template
is removed with its last fork (``collect``). The design: docs/decisions/0002-microvm-snapshots.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from moorage.errors import ConflictError, InvalidInput
from moorage.log import get_logger
from moorage.sandbox import microvm_memfd
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_user
from moorage.sandbox.base import (
    ChannelError,
    SandboxError,
    SandboxNotFound,
    SandboxState,
    SandboxStateError,
    SnapshotIncompatible,
    TemplateRef,
    validate_id,
)
from moorage.fsync import fsync_dir
from moorage.sandbox.microvm_files import qemu_img, write_json
from moorage.sandbox.microvm_qemu import qemu_version

if TYPE_CHECKING:
    from moorage.sandbox.microvm import MicroVMDriver
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

log = get_logger(__name__)

#: The folder under the driver's root that holds its templates.
TEMPLATES = ".templates"
#: The empty overlay on a template's disk that each fork's disk starts as (a copy, no qemu-img run per fork).
CHILD_DISK = "child.qcow2"


def collect(tdir: Path) -> None:
    """Remove a deleted template once no fork depends on its RAM and disk any more."""
    children = tdir / "children"
    if (tdir / "deleted").exists() and not (children.exists() and any(children.iterdir())):
        microvm_memfd.release(tdir / "ram")
        microvm_user.release(tdir)  # the group id its forks had
        shutil.rmtree(tdir, ignore_errors=True)


#: A template's sealed RAM copy is made ahead of its first fork only while at least this share of the host's
#: memory stays available afterwards (it stays in memory as long as the template is on this host).
WARM_KEEPS_AVAILABLE = 0.5


def _meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields["MemAvailable"], fields["MemTotal"]


def warm(tdir: Path) -> bool:
    """Make the sealed in-memory copy of the template's RAM that its forks map (``microvm_memfd``), which the
    first fork launched in this process would otherwise make (100-300 ms for a 256 MiB guest here), if the host
    keeps ``WARM_KEEPS_AVAILABLE`` of its memory available afterwards. Only on a root host (an unprivileged one
    maps the file itself). Blocking; returns whether it was made now."""
    ram_file = tdir / "ram"
    if os.geteuid() != 0 or (tdir / "deleted").exists() or not ram_file.exists() or microvm_memfd.ready(ram_file):
        return False
    available, total = _meminfo()
    if available - ram_file.stat().st_size < total * WARM_KEEPS_AVAILABLE:
        log.debug("template RAM not sealed ahead: the host's memory is needed elsewhere", template=tdir.name,
                 available_mib=available >> 20)
        return False
    microvm_memfd.sealed_ram(ram_file)
    return True


async def make(driver: "MicroVMDriver", sandbox: "MicroVMSandbox", tid: str, *, standalone: bool = False) -> TemplateRef:
    """Template ``tid`` of a running sandbox (paused for the copy, running again afterwards). A fork's template
    has its RAM whole and its disk an overlay on its source template's, or, ``standalone``, on the guest image
    (what the source template's disk holds copied in: ``_flatten``)."""
    tdir = driver.template_dir(tid)
    if tdir.exists():
        raise ConflictError(f"template {tid} already exists", hint="delete_template() it first or pick another id")
    async with sandbox._lock:
        if sandbox.state is not SandboxState.RUNNING or sandbox._qmp is None or sandbox.pid is None:
            raise SandboxStateError(f"sandbox {sandbox.id} must be running to become a template", hint="wake() it first")
        # Flush the guest's dirty pages so the template's disk alone holds every file (a fork whose snapshot
        # is unusable cold-boots from it), and drop its page cache: measured here, forks of a template with
        # its cache dropped answer their first call after a wake ~20 ms sooner (wake p50 ~90 vs ~110 ms).
        try:
            await sandbox.exec(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], timeout=30)
        except ChannelError as e:
            log.warning("guest sync before template failed", sandbox=sandbox.id, error=str(e))
        tmp = tdir.with_name(tid + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "children").mkdir()
        qmp = sandbox._qmp
        await qmp.execute("stop")
        try:
            await qmp.save_device_state(tmp / "dev.state")
            m = ram.find_mapping(sandbox.pid, sandbox._ram_path())
            await asyncio.to_thread(ram.read_all, sandbox.pid, m, tmp / "ram")
            # Root's alone from the start on a root host (forks map a sealed copy, microvm_memfd); an
            # unprivileged host's QEMU maps the file itself and opens it read-write.
            os.chmod(tmp / "ram", 0o400 if os.geteuid() == 0 else 0o600)
            await asyncio.to_thread(shutil.copyfile, sandbox.dir / "disk.qcow2", tmp / "disk.qcow2")
            # Its QEMU can write the disk's header: a template (root's, shared) never inherits a backing file
            # other than the one the host gave the sandbox.
            microvm_user.check_backing(tmp / "disk.qcow2", sandbox.dir)
        finally:
            await qmp.execute("cont")
        if standalone and sandbox._meta.get("template_dir"):
            try:
                await _flatten(tmp / "disk.qcow2", sandbox._image.rootfs)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        # Internal snapshots (checkpoints) of the source are not part of the template.
        subprocess.run(["qemu-img", "snapshot", "-l", str(tmp / "disk.qcow2")], capture_output=True)
        ram.fsync_path(tmp / "disk.qcow2")
        ram.fsync_path(tmp / "dev.state")
        (tmp / "disk.qcow2").chmod(0o444)
        meta = {
            "id": tid,
            "source_sandbox": sandbox.id,
            "image_id": sandbox._meta["image_id"],
            "image_dir": sandbox._meta["image_dir"],
            "vm": sandbox._meta["vm"],
            "spec": sandbox._meta["spec"],
            "snapshot": {
                "kind": "delta",
                "qemu": qemu_version(),
                "layout": sandbox._vm_config().layout_id(),
                "image": sandbox._meta["image_id"],
                "dev_sha256": ram.sha256_file(tmp / "dev.state"),
                "created_at": time.time(),
            },
            "created_at": time.time(),
        }
        write_json(tmp / "template.json", meta)
        os.rename(tmp, tdir)
        fsync_dir(tdir.parent)
    # The empty overlay every fork's disk starts as (its backing path is the template's final place). Forks
    # made before it exists, or if this fails, create their overlay themselves.
    try:
        await qemu_img("create", "-q", "-f", "qcow2", "-b", str(tdir / "disk.qcow2"), "-F", "qcow2",
                       str(tdir / (CHILD_DISK + ".new")))
        ram.fsync_path(tdir / (CHILD_DISK + ".new"))
        os.rename(tdir / (CHILD_DISK + ".new"), tdir / CHILD_DISK)
    except SandboxError as e:
        log.warning("no child overlay for template; forks create theirs", template=tid, error=str(e))
    log.info("template made", template=tid, source=sandbox.id)
    return TemplateRef(id=tid, driver=driver.name, path=tdir, source_sandbox=sandbox.id, created_at=meta["created_at"],
                       includes_memory=True)


async def _flatten(disk: Path, rootfs: Path) -> None:
    """``disk`` (an overlay on a template's disk, itself on the image's ``rootfs``) made an overlay on ``rootfs``
    itself: ``qemu-img rebase`` in its safe mode copies in what the template's disk holds over the image (only
    that: the new backing file is the old one's own), so the result reads the same bytes everywhere."""
    started = time.monotonic()
    await qemu_img("rebase", "-q", "-f", "qcow2", "-b", str(rootfs), "-F", "raw", str(disk))
    log.debug("template disk made standalone", disk=str(disk), ms=round((time.monotonic() - started) * 1000))


def delete(template: TemplateRef) -> None:
    """No new forks from it; its files go when the last fork that maps its RAM and disk is destroyed."""
    tdir = Path(template.path)
    if not (tdir / "template.json").exists():
        return
    (tdir / "deleted").write_text(str(time.time()))
    collect(tdir)


def forkable(driver: "MicroVMDriver", template: TemplateRef, ids: Sequence[str]) -> dict[str, Any]:
    """The template's record, once it and the new ids are checked (nothing is made before every check passes)."""
    if template.driver != driver.name:
        raise SnapshotIncompatible(f"template {template.id} was made by the {template.driver} driver",
                                   hint="fork it with that driver, or make a template with the microvm driver")
    tdir = Path(template.path)
    try:
        tmeta: dict[str, Any] = json.loads((tdir / "template.json").read_text())
    except FileNotFoundError as e:
        raise SandboxNotFound(f"template {template.id} not found at {tdir}") from e
    if (tdir / "deleted").exists():
        raise SandboxNotFound(f"template {template.id} was deleted", hint="make a new template")
    if tmeta.get("snapshot", {}).get("qemu") != qemu_version():
        raise SnapshotIncompatible(f"template {template.id} was made with {tmeta.get('snapshot', {}).get('qemu')}, "
                                   f"this host runs {qemu_version()}", hint="make the template again on this host")
    for sid in ids:
        validate_id(sid)
        if (driver.root / sid).exists():
            raise ConflictError(f"sandbox {sid} already exists", hint="pick another id or destroy it first")
    if len(set(ids)) != len(ids):
        raise InvalidInput("fork ids must be distinct")
    return tmeta


async def fork_one(driver: "MicroVMDriver", tdir: Path, tmeta: dict[str, Any], sid: str) -> dict[str, Any]:
    """The directory of fork ``sid``, asleep at the template's state; returns its metadata (already on disk)."""
    d = driver.root / sid
    (d / "snapshot").mkdir(parents=True)
    if (tdir / CHILD_DISK).exists():
        # Every child's disk starts as the same empty overlay on the template's disk: copy it (no process).
        await asyncio.to_thread(shutil.copyfile, tdir / CHILD_DISK, d / "disk.qcow2")
    else:  # a template made before child overlays were kept
        await qemu_img("create", "-q", "-f", "qcow2", "-b", str(tdir / "disk.qcow2"), "-F", "qcow2",
                       str(d / "disk.qcow2"), sandbox_dir=d)
    # A fresh fork's snapshot is the template's device state with an empty RAM delta.
    shutil.copyfile(tdir / "dev.state", d / "snapshot" / "dev.state")
    (d / "snapshot" / "ram.delta").write_bytes(b"")
    (d / "snapshot" / "ram.idx").write_bytes(b"")
    record = dict(tmeta["snapshot"], delta_bytes=0, delta_xxh3=ram.delta_digest(d / "snapshot" / "ram.delta"))
    write_json(d / "snapshot" / "snapshot.json", record)
    (tdir / "children" / sid).write_text("")
    meta = {
        "id": sid,
        "driver": driver.name,
        "spec": tmeta["spec"],
        "image_id": tmeta["image_id"],
        "image_dir": tmeta["image_dir"],
        "vm": tmeta["vm"],
        "ram_mode": "delta",
        "template_dir": str(tdir),
        "template_id": tmeta["id"],
        "state": SandboxState.SLEEPING.value,
        "pid": None,
        "snapshot": record,
        "fresh_fork": True,
        "created_at": time.time(),
    }
    write_json(d / "meta.json", meta)
    return meta
