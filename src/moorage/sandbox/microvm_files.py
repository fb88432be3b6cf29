"""File work shared by the micro-VM driver's parts: durable JSON, sparse copies, qcow2 headers and ``qemu-img``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from moorage.fsync import fsync_dir
from moorage.sandbox.base import SandboxError
from moorage.sandbox.microvm_ram import fsync_path


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic and durable: a crash leaves the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)



def allocated(path: Path) -> int:
    """Bytes a file or tree really uses on disk (sparse RAM files are mostly holes)."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of ``src`` (a 256 MiB RAM file holds ~half holes)."""
    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.truncate(size)
        ifd, ofd = fi.fileno(), fo.fileno()
        off = 0
        while off < size:
            try:
                data = os.lseek(ifd, off, os.SEEK_DATA)
            except OSError:
                break  # no more data
            hole = os.lseek(ifd, data, os.SEEK_HOLE)
            pos = data
            while pos < hole:
                n = os.copy_file_range(ifd, ofd, hole - pos, pos, pos)
                if n <= 0:
                    break
                pos += n
            off = hole
        os.fsync(ofd)


async def qemu_img(*args: str, sandbox_dir: Path | None = None) -> None:
    """Run ``qemu-img``; on failure remove ``sandbox_dir`` (a half-made sandbox) and raise ``SandboxError``."""
    r = await asyncio.create_subprocess_exec("qemu-img", *args, stderr=asyncio.subprocess.PIPE)
    _, err = await r.communicate()
    if r.returncode != 0:
        if sandbox_dir is not None:
            shutil.rmtree(sandbox_dir, ignore_errors=True)
        raise SandboxError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()}")


def qcow2_backing(path: Path) -> str | None:
    """The backing file name written in a qcow2 header (None: no backing, or not a qcow2 file)."""
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:4] != b"QFI\xfb":
            return None
        offset, size = int.from_bytes(head[8:16], "big"), int.from_bytes(head[16:20], "big")
        if not offset or not size:
            return None
        f.seek(offset)
        return f.read(size).decode(errors="replace")


def rebase(disk: Path, backing: Path, fmt: str) -> bool:
    """Point ``disk``'s qcow2 header at ``backing`` (same bytes, another path: ``-u`` copies nothing). Blocking;
    returns whether the header changed. A read-only file (a template's disk) is made writable for the call."""
    if qcow2_backing(disk) == str(backing):
        return False
    mode = disk.stat().st_mode & 0o777
    if not mode & 0o200:
        disk.chmod(mode | 0o200)
    try:
        r = subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(backing), "-F", fmt, str(disk)],
                           capture_output=True, text=True)
    finally:
        if not mode & 0o200:
            disk.chmod(mode)
    if r.returncode != 0:
        raise SandboxError(f"qemu-img rebase of {disk} failed: {r.stderr.strip()}",
                           hint="check the disk file; it may be damaged")
    fsync_path(disk)
