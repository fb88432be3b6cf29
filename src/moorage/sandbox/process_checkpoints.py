"""A process sandbox's checkpoints on disk. ``checkpoints/<name>/`` holds a copy of the layer (files unchanged
since the newest checkpoint are hard links to its copy: process_snapshot.py), that copy's index and
``checkpoint.json``. Processes and memory are not part of it. Everything here blocks: callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from moorage.log import get_logger
from moorage.sandbox.base import CheckpointInfo
from moorage.sandbox.process_fs import disk_usage, write_json_durable
from moorage.sandbox.process_snapshot import INDEX, snapshot_tree, write_index

log = get_logger(__name__)

#: In a checkpoint's hidden copy while it is made: its maker holds an exclusive lock on it, which the kernel lets go
#: when the maker dies (SIGKILL included), so a copy whose lock can be taken is a crash's leftover.
MAKING = ".making"
#: A hidden copy without its lock file (its maker died between the directory and the lock) counts as left over
#: once this old.
UNLOCKED_STALE_S = 60.0


def take(sandbox_dir: Path, sandbox_id: str, name: str) -> CheckpointInfo:
    """Checkpoint ``sandbox_dir``'s layer as ``name`` (the caller checked that the name is free). Made under a
    hidden name and renamed: a crash never leaves half a checkpoint under its name."""
    tmp = sandbox_dir / "checkpoints" / f".{name}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    making = os.open(tmp / MAKING, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(making, fcntl.LOCK_EX)  # held until it has its name: a sweep leaves it alone meanwhile
        return _take(sandbox_dir, sandbox_id, name, tmp)
    finally:
        os.close(making)


def _take(sandbox_dir: Path, sandbox_id: str, name: str, tmp: Path) -> CheckpointInfo:
    dest = sandbox_dir / "checkpoints" / name
    # Incremental: files unchanged since the newest checkpoint are linked to its copy (process_snapshot).
    prev = newest(sandbox_dir)
    t0 = time.perf_counter()
    try:
        index = snapshot_tree(sandbox_dir / "layer", tmp / "layer", prev)
        write_index(tmp, index)
        created = time.time()
        # Inside the ``try``: a record that does not fit (the disk full) removes the copy too, which no one else
        # would (a hidden name is no checkpoint), so it does not hold the space it took.
        write_json_durable(tmp / "checkpoint.json", {"name": name, "created_at": created, "driver": "process"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.rename(tmp, dest)
    with contextlib.suppress(OSError):
        os.unlink(dest / MAKING)
    log.info("checkpoint", sandbox=sandbox_id, checkpoint=name, linked=index["linked"], copied=index["copied"],
             ms=round((time.perf_counter() - t0) * 1e3, 1))
    # What it added to the older ones: its copies and directories (counted as they were made, not by walking
    # every older checkpoint, which grows with their number), its index and record.
    added = index["added"] + sum(os.lstat(p).st_blocks * 512 for p in (dest, dest / INDEX, dest / "checkpoint.json"))
    return CheckpointInfo(name, sandbox_id, dest, added, created, includes_memory=False)


def sweep_unfinished(sandbox_dir: Path) -> list[Path]:
    """Remove the hidden copies of checkpoints whose making a crash cut short (the host SIGKILLed, the machine
    gone): no checkpoint is named by them, nothing else would remove them, and each holds a copy of the layer. One
    being made now (by another process on the same directory) holds its lock and stays. Returns those removed."""
    base = sandbox_dir / "checkpoints"
    gone = []
    for d in base.iterdir() if base.is_dir() else ():
        if not d.name.startswith(".") or ".deleting-" in d.name or not d.is_dir():
            continue  # a checkpoint, or one being removed (the sandbox's boot sweeps those)
        try:
            fd = os.open(d / MAKING, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                if time.time() - d.stat().st_mtime < UNLOCKED_STALE_S:
                    continue
            except OSError:
                continue
        except OSError:
            continue
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its maker is alive: being made now
            finally:
                os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    if gone:
        log.warning("removed checkpoint copies a crash left half made", sandbox=sandbox_dir.name,
                    copies=[d.name for d in gone])
    return gone


def dirs(sandbox_dir: Path) -> list[Path]:
    """Checkpoint directories, oldest first (hidden ones, being made or removed, left out)."""
    base = sandbox_dir / "checkpoints"
    found = []
    for d in base.iterdir() if base.exists() else []:
        if d.name.startswith("."):
            continue
        try:
            found.append((json.loads((d / "checkpoint.json").read_text())["created_at"], d))
        except (OSError, ValueError, KeyError):
            continue
    return [d for _, d in sorted(found)]


def newest(sandbox_dir: Path) -> Path | None:
    """The newest checkpoint with an index (the one a new checkpoint links its unchanged files to)."""
    found = [d for d in dirs(sandbox_dir) if (d / INDEX).exists()]
    return found[-1] if found else None


def listing(sandbox_dir: Path, sandbox_id: str) -> list[CheckpointInfo]:
    """Every checkpoint, by name. Each one's bytes are what it added to the older ones (files it shares with an
    older checkpoint count there), so their sum is the disk all of them take."""
    out = []
    seen: set[tuple[int, int]] = set()
    for d in dirs(sandbox_dir):
        try:
            info = json.loads((d / "checkpoint.json").read_text())
            out.append(CheckpointInfo(d.name, sandbox_id, d, disk_usage(d, seen), info["created_at"],
                                      includes_memory=False))
        except (OSError, ValueError, KeyError):
            continue  # deleted (renamed aside, outside the sandbox's lock) since ``dirs`` saw it: no checkpoint now
    return sorted(out, key=lambda c: c.name)
