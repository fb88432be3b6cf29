"""Incremental checkpoints of a process sandbox's layer: files unchanged since the previous checkpoint are hard links
to that checkpoint's copy, only changed files are copied.

A checkpoint records, per regular file of the live layer, the identity it had when copied (inode, size, mtime,
ctime). The next checkpoint links a file instead of copying it only when all four still match: any write, truncate,
chmod, chown or rename-over changes ctime, which a sandbox cannot set. A file whose ctime was within ``_RACY_NS`` of
the moment it was examined is not recorded at all (timestamps advance in clock ticks, so a write just after the copy
could keep the same ctime): it is copied again next time. Checkpoint files are host-only and never written after
they are made, so sharing them between checkpoints is safe; a rollback copies them back into a fresh layer (new
inodes), so the live layer never shares an inode with a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

INDEX = "index.json"
#: A file changed this recently when examined is copied again at the next checkpoint (several timestamp ticks).
_RACY_NS = 100_000_000


def _copy_file(src: str, dst: str, st: os.stat_result) -> None:
    shutil.copyfile(src, dst, follow_symlinks=False)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def snapshot_tree(src: Path, dst: Path, prev: Path | None) -> dict[str, Any]:
    """Copy the tree ``src`` to the new directory ``dst`` (modes, owners, times, symlinks, FIFOs and hard links
    kept), linking files unchanged since the checkpoint directory ``prev`` (its ``layer`` and ``INDEX``) instead of
    copying them. Returns the index to store beside ``dst``, plus counts of what was linked and copied."""
    old: dict[str, list[int]] = {}
    old_dev = None
    if prev is not None:
        try:
            recorded = json.loads((prev / INDEX).read_text())
            old, old_dev = recorded["files"], recorded["dev"]
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
    src_dev = os.stat(src).st_dev
    if old_dev != src_dev:
        old = {}
    files: dict[str, list[int]] = {}
    inodes: dict[int, str] = {}  # live inode -> its first copy here (hard links inside the layer stay links)
    linked = copied = added = 0  # added: bytes allocated to what this checkpoint does not share with ``prev``
    dirs: list[tuple[str, os.stat_result]] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        s_dir = os.path.join(src, rel) if rel else str(src)
        d_dir = os.path.join(dst, rel) if rel else str(dst)
        st = os.lstat(s_dir)
        os.mkdir(d_dir, 0o700)
        dirs.append((d_dir, st))
        with os.scandir(s_dir) as it:
            entries = list(it)
        for e in entries:
            r = os.path.join(rel, e.name) if rel else e.name
            s_path, d_path = e.path, os.path.join(d_dir, e.name)
            est = e.stat(follow_symlinks=False)
            mode = est.st_mode
            if stat.S_ISDIR(mode):
                stack.append(r)
            elif stat.S_ISLNK(mode):
                os.symlink(os.readlink(s_path), d_path)
                os.chown(d_path, est.st_uid, est.st_gid, follow_symlinks=False)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(d_path, stat.S_IMODE(mode))
                os.chown(d_path, est.st_uid, est.st_gid, follow_symlinks=False)
            elif stat.S_ISREG(mode):
                ident = [est.st_ino, est.st_size, est.st_mtime_ns, est.st_ctime_ns]
                first = inodes.get(est.st_ino)
                if first is not None:
                    os.link(first, d_path)
                    continue
                inodes[est.st_ino] = d_path
                if old.get(r) == ident and prev is not None:
                    try:
                        os.link(prev / "layer" / r, d_path)
                        linked += 1
                    except OSError:
                        _copy_file(s_path, d_path, est)
                        copied += 1
                        added += os.lstat(d_path).st_blocks * 512
                else:
                    _copy_file(s_path, d_path, est)
                    copied += 1
                    added += os.lstat(d_path).st_blocks * 512
                if time.time_ns() - est.st_ctime_ns > _RACY_NS:
                    files[r] = ident
            # Sockets and device nodes are not copied (like a sandbox restart, which recreates its sockets).
    for d_dir, st in reversed(dirs):  # deepest first: setting a directory's times must come after its contents
        os.chown(d_dir, st.st_uid, st.st_gid)
        os.chmod(d_dir, stat.S_IMODE(st.st_mode))
        os.utime(d_dir, ns=(st.st_atime_ns, st.st_mtime_ns))
        added += os.lstat(d_dir).st_blocks * 512
    return {"dev": src_dev, "files": files, "linked": linked, "copied": copied, "added": added}


def write_index(checkpoint_dir: Path, index: dict[str, Any]) -> None:
    fd = os.open(checkpoint_dir / INDEX, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as f:
        json.dump({"dev": index["dev"], "files": index["files"]}, f, separators=(",", ":"))
