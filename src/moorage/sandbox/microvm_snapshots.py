"""The files of a micro-VM's snapshots and checkpoints: records, checks, atomic replacement, a rollback's staged
memory image and the disk's internal snapshots. Blocking functions (callers run them on a worker thread); what
needs QEMU (pausing, saving device state, reading RAM) stays with the sandbox (``microvm_sandbox``).

A directory holds ``dev.state`` (device state), the RAM (``ram.delta`` + ``ram.idx`` for a fork, a checkpoint's
chained pages, or a copy of the RAM file) and, for checkpoints and copies, ``snapshot.json`` (its record). It is
written as ``<name>.new`` and renamed into place, so a crash leaves the old or the new one, never half of one; a
``.new`` a crash cut short (no process makes it any more: it holds no lock) is removed when the host next opens the
sandbox (``sweep_unfinished``), and so is the disk snapshot of such a checkpoint. A replacement moves the old one
aside as ``<name>.old`` first: a crash between the two renames is settled at that open too (``settle_swaps``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from moorage.log import get_logger
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_ram_chain as ram_chain
from moorage.sandbox.base import CheckpointInfo, SnapshotCorrupt, SnapshotIncompatible
from moorage.fsync import fsync_dir
from moorage.sandbox.microvm_files import allocated, write_json
from moorage.sandbox.microvm_qemu import qemu_version

log = get_logger(__name__)

#: In a ``.new`` directory while it is made: its maker holds an exclusive lock on it, which the kernel lets go when
#: the maker dies (SIGKILL included), so a ``.new`` whose lock can be taken is a crash's leftover.
MAKING = ".making"
#: A ``.new`` without its lock file (left by a host from before the lock) counts as left over once this old.
UNLOCKED_STALE_S = 60.0


class Phases:
    """Milliseconds per step of a sleep or wake, logged with it (where the time goes on a given host)."""

    def __init__(self) -> None:
        self._t = time.monotonic()
        self.ms: dict[str, int] = {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.ms[name] = round((now - self._t) * 1000)
        self._t = now

    def total(self) -> int:
        return sum(self.ms.values())


def new_record(kind: str, layout: str, image_id: str, **extra: Any) -> dict[str, Any]:
    """What a snapshot was taken with: a wake checks it against this host before loading anything."""
    return {"kind": kind, "qemu": qemu_version(), "layout": layout, "image": image_id, "created_at": time.time(), **extra}


def begin(new: Path) -> int:
    """The directory ``new`` made (empty) for a snapshot, marked as being made: the descriptor returned holds its
    lock until it is closed (``os.close``, once ``new`` is in place or removed)."""
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    fd = os.open(new / MAKING, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def sweep_unfinished(sandbox_dir: Path) -> list[Path]:
    """Remove the ``.new`` directories of a sleep's snapshot (``snapshot.new``) and of checkpoints whose making a
    crash cut short (the host SIGKILLed): nothing names them, nothing else removes them, and each can hold a copy
    of the guest's memory. One a live process makes now holds its lock and stays. Returns those removed."""
    settle_swaps(sandbox_dir)  # first: a replacement cut short between its renames needs its ``.new``
    found = [sandbox_dir / "snapshot.new", *sorted((sandbox_dir / "checkpoints").glob("*.new"))]
    gone = [d for d in found if d.is_dir() and _left_over(d)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    if gone:
        log.warning("removed snapshots a crash left half made", sandbox=sandbox_dir.name,
                    snapshots=[str(d.relative_to(sandbox_dir)) for d in gone])
    return gone


def settle_swaps(sandbox_dir: Path) -> list[Path]:
    """Finish or undo each replacement (``swap_in``) a crash cut short between its two renames: its target gone,
    the one it replaced as ``<name>.old``. A whole ``<name>.new`` (its lock file removed, as ``swap_in`` does
    first) takes the target's place; else the old one goes back. A ``.old`` beside its target (the last removal
    cut short) is removed. Returns the targets put back in place."""
    settled = []
    for old in [sandbox_dir / "snapshot.old", *sorted((sandbox_dir / "checkpoints").glob("*.old"))]:
        if not old.is_dir():
            continue
        target = old.with_name(old.name[:-4])
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            continue
        new = target.with_name(target.name + ".new")
        whole = new.is_dir() and not (new / MAKING).exists()
        os.rename(new if whole else old, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
        settled.append(target)
        log.warning("settled a replacement a crash cut short", sandbox=sandbox_dir.name,
                    snapshot=str(target.relative_to(sandbox_dir)), kept="new" if whole else "old")
    return settled


def _left_over(d: Path) -> bool:
    try:
        fd = os.open(d / MAKING, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return time.time() - d.stat().st_mtime >= UNLOCKED_STALE_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its maker is alive: being made now
    finally:
        os.close(fd)
    return True


def stray_disk_snapshots(checkpoints: Path, tags: list[str]) -> list[str]:
    """The disk's checkpoint snapshots (``ckpt-<name>``, of ``tags``) that no checkpoint names: no record of that
    name (its files never written whole) and none being made."""
    return [t for t in tags if t.startswith("ckpt-") and not (checkpoints / (t[5:] + ".new")).exists()
            and not (checkpoints / t[5:] / "snapshot.json").exists()]


def unrecorded(checkpoints: Path) -> bool:
    """Whether a checkpoint directory has lost its record (deleted; its RAM may be kept for those that build on it,
    ``ram_chain.collect``): its disk snapshot may be left if a crash cut its deletion short."""
    return any(d.is_dir() and not d.name.startswith(".") and not d.name.endswith(".new")
               and not (d / "snapshot.json").exists() for d in (checkpoints.iterdir() if checkpoints.is_dir() else ()))


def disk_snapshots(disk: Path) -> list[str]:
    """The tags of the internal snapshots of a disk no QEMU holds (its backing file checked by the caller)."""
    r = subprocess.run(["qemu-img", "snapshot", "-l", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SnapshotCorrupt(f"cannot list the snapshots of {disk}: {r.stderr.strip()}")
    # "Snapshot list:", the header, then one line per snapshot: ID TAG VM-SIZE DATE ...
    return [line.split()[1] for line in r.stdout.splitlines()[2:] if len(line.split()) > 1]


def swap_in(new: Path, target: Path) -> None:
    """Put the finished directory ``new`` in ``target``'s place (the old one, if any, removed after)."""
    (new / MAKING).unlink(missing_ok=True)  # whole now (its maker still holds the lock until it is in place)
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.rename(target, old)
    os.rename(new, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def commit(cap: "ram_chain.Capture | None", new: Path, target: Path, record: dict[str, Any], disk: Path, *,
           keep_running: bool, ph: Phases) -> None:
    """Store a captured checkpoint's pages (``cap``), sync the directory ``new`` (and ``disk``, whose internal
    snapshot table may have changed) and put it in ``target``'s place."""
    if cap is not None:
        saved = ram_chain.write(cap, new)
        record.update(delta_bytes=saved["delta_bytes"], stored_bytes=saved["stored_bytes"], ram_bytes=saved["ram_bytes"])
        ph.mark("ram_write")
    ram.fsync_path(new / "dev.state")
    ram.fsync_path(disk)
    record["dev_sha256"] = ram.sha256_file(new / "dev.state")
    if keep_running:
        write_json(new / "snapshot.json", record)  # checkpoints carry their own record; sleeps use meta.json
    swap_in(new, target)


def validate(sandbox_id: str, sandbox_dir: Path, snap_dir: Path, record: dict[str, Any] | None, layout: str) -> dict[str, Any]:
    """``record`` once the snapshot in ``snap_dir`` is found whole and loadable on this host, else
    ``SnapshotCorrupt`` / ``SnapshotIncompatible`` (the wake then cold-boots from the disk)."""
    if not record:
        raise SnapshotCorrupt(f"sandbox {sandbox_id} has no snapshot record", hint="it cold-boots from its disk")
    if record.get("qemu") != qemu_version() or record.get("layout") != layout:
        raise SnapshotIncompatible(
            f"snapshot of {sandbox_id} was taken by {record.get('qemu')} with layout {record.get('layout')}; this host runs {qemu_version()} with layout {layout}",
            hint="it cold-boots from its disk; processes in memory are lost, files are kept",
        )
    dev = snap_dir / "dev.state"
    if not dev.exists() or ram.sha256_file(dev) != record.get("dev_sha256"):
        raise SnapshotCorrupt(f"device state of {sandbox_id} is missing or fails its checksum", hint="it cold-boots from its disk")
    if record["kind"] == "delta":
        delta = snap_dir / "ram.delta"
        if not delta.exists() or not (snap_dir / "ram.idx").exists() or not ram.delta_matches(delta, record):
            raise SnapshotCorrupt(f"RAM delta of {sandbox_id} is missing or fails its checksum", hint="it cold-boots from its disk")
    else:
        ram_file = snap_dir / "ram" if (snap_dir / "ram").exists() else sandbox_dir / "ram"
        if not ram_file.exists() or not ram.digest_matches(ram_file, record.get("ram_checksum")):
            raise SnapshotCorrupt(f"RAM file of {sandbox_id} is missing, truncated or changed", hint="it cold-boots from its disk")
    return record


def chain_base(checkpoints: Path, tip: str | None, name: str) -> Path | None:
    """The checkpoint a new one named ``name`` stores its pages against: the one this guest last passed (taken
    or rolled back to), while its pages exist; None for a whole one. Taken again under the same name: a whole one
    (what built on the old one keeps it, ``ram_chain.set_aside``)."""
    if tip and tip != name and (checkpoints / tip / ram_chain.CHAIN).exists():
        return checkpoints / tip
    return None


def stage_rollback(src: Path, staged: Path) -> dict[str, Any]:
    """The memory image of checkpoint ``src`` put together as a snapshot directory ``staged`` (its record
    returned): a checkpoint whose RAM cannot be put together (a base's pages gone or changed) raises here, before
    anything of the sandbox changed."""
    record: dict[str, Any] = json.loads((src / "snapshot.json").read_text())
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    try:
        shutil.copyfile(src / "dev.state", staged / "dev.state")
        if record["kind"] == "delta":
            # The whole delta, put together from the pages of this checkpoint and those it builds on.
            record.pop("delta_sha256", None)
            record["delta_bytes"], record["delta_xxh3"] = ram_chain.materialize(src.parent, src.name, staged)
        write_json(staged / "snapshot.json", record)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return record


def revert_disk(disk: Path, name: str) -> None:
    """The disk (no QEMU holding it) back to checkpoint ``name``'s internal snapshot."""
    r = subprocess.run(["qemu-img", "snapshot", "-a", f"ckpt-{name}", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SnapshotCorrupt(f"cannot restore the disk of checkpoint {name}: {r.stderr.strip()}")


def drop_disk_snapshot(sandbox_id: str, disk: Path, tag: str) -> None:
    """Delete the internal snapshot ``tag`` of a disk no QEMU holds (a failure is logged: only space is lost)."""
    r = subprocess.run(["qemu-img", "snapshot", "-d", tag, str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("could not delete a checkpoint's disk snapshot", sandbox=sandbox_id, error=r.stderr.strip())


def listing(sandbox_id: str, checkpoints: Path) -> list[CheckpointInfo]:
    """The checkpoints written under ``checkpoints`` (a directory without its record is not one), by name."""
    out = []
    if checkpoints.exists():
        for d in sorted(checkpoints.iterdir()):
            try:
                rec = json.loads((d / "snapshot.json").read_text())
                out.append(CheckpointInfo(d.name, sandbox_id, d, allocated(d), rec["created_at"], True))
            except (OSError, ValueError, KeyError):
                continue  # none yet, or deleted since the directory was read: no checkpoint now
    return out
