"""Filesystem helpers of the process driver: layer copies (reflink where possible), disk usage, durable JSON,
the start time of a process (/proc).

Kept apart from process.py so the copy and accounting rules are in one small place.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from moorage.fsync import fsync_dir
from moorage.sandbox.base import SandboxError


async def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to the new path ``dst`` preserving modes, links and times; shares blocks on reflink filesystems."""
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", "--reflink=auto", "--", str(src), str(dst),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"copying {src} to {dst} failed: {err.decode(errors='replace').strip()}",
                           hint="check free disk space under the sandboxes directory")


def disk_usage(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes allocated under ``path`` (like ``du -s``: blocks, hard links counted once, symlinks not followed).
    Files whose inode is in ``seen`` are not counted (and those counted are added to it): shared across calls, it
    attributes a file linked from several trees to the first one measured."""
    total = 0
    seen = set() if seen is None else seen
    stack = [str(path)]
    while stack:
        top = stack.pop()
        try:
            st = os.lstat(top)
        except OSError:
            continue
        total += st.st_blocks * 512
        try:
            it = os.scandir(top)
        except (NotADirectoryError, PermissionError, FileNotFoundError):
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
    return total


def proc_starttime(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks: (pid, start time) names one process across pid reuse. None when
    the process is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def write_json_durable(path: Path, data: Any) -> None:
    """Replace ``path`` atomically and durably: a crash leaves the old or the new content, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    # Host-only metadata: owner read/write, whatever the umask (sandbox files are never world-readable).
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
