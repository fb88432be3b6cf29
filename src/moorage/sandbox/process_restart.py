"""Restarting a process sandbox's agent without a new sandbox: the guest's zygote, its control socket, and the
layer restored in place under the running sandbox's bind mounts (the process driver's fast rollback).

The sandbox's first process is a *zygote* (``guest/supervisor.py``): the guest's Python with its imports done
and no agent code, which forks each supervisor. On a rollback the host has the zygote kill the supervisor, kills
whatever else runs in the sandbox, puts the checkpoint's files in place and has the zygote fork a fresh
supervisor: a few milliseconds instead of a new bubblewrap sandbox and interpreter (~110 ms here).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

from moorage.aio import within
from moorage.sandbox import process_limits as limits

#: Directories of the layer bound into the running sandbox: their contents are swapped, never the directory.
BOUND = ("work", "tmp")
_REPLY_TIMEOUT_S = 5.0


class ZygoteGone(Exception):
    """The zygote did not answer: the caller restarts the sandbox the slow way."""


def control_pair(min_fd: int = 10) -> tuple[socket.socket, int]:
    """The host's end of a new control socket, and the sandbox's end as an inheritable descriptor numbered
    ``min_fd`` or above (the launcher's shell uses low numbers). The caller closes the descriptor after the
    launch."""
    host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = fcntl.fcntl(guest.fileno(), fcntl.F_DUPFD, min_fd)  # not close-on-exec: the launcher inherits it
    guest.close()
    host.setblocking(False)
    return host, fd


async def _ask(ctl: socket.socket, cmd: bytes, want: bytes | None) -> None:
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(ctl, cmd)
        if want is not None:
            got = await within(loop.sock_recv(ctl, 1), _REPLY_TIMEOUT_S)
            if got != want:
                raise ZygoteGone(f"zygote answered {got!r}")
    except (OSError, asyncio.TimeoutError) as e:
        raise ZygoteGone(str(e)) from e


async def kill_agent(ctl: socket.socket, root_pid: int, is_guest: Callable[[int], bool]) -> None:
    """Have the zygote kill and reap the supervisor, then kill every other process of the sandbox (the agent's
    workers, orphans adopted by the sandbox's init) except the zygote and the sandbox's own init."""
    await _ask(ctl, b"K", b"k")
    keep = set(_zygote_and_ancestors(root_pid, is_guest))
    deadline = time.monotonic() + _REPLY_TIMEOUT_S
    while time.monotonic() < deadline:
        victims = [p for p in limits.descendants(root_pid) if p not in keep]
        if not victims:
            return
        limits.kill_pids(victims)
        await asyncio.sleep(0.002)
    raise ZygoteGone("processes of the sandbox survived SIGKILL")


async def start_agent(ctl: socket.socket) -> None:
    """Have the zygote fork a fresh supervisor (which listens on the sandbox's socket as at boot)."""
    await _ask(ctl, b"G", None)


def _zygote_and_ancestors(root_pid: int, is_guest: Callable[[int], bool]) -> list[int]:
    """The zygote (the outermost guest process) and the processes between it and ``root_pid``."""
    for pid in limits.descendants(root_pid):  # breadth first: the outermost guest process comes first
        if is_guest(pid):
            out, p = [pid], _ppid(pid)
            while p is not None and p != root_pid and p > 1:
                out.append(p)
                p = _ppid(p)
            return out
    raise ZygoteGone("no zygote in the sandbox")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def swap_contents(layer: Path, fresh: Path, trash: Path, mounted: tuple[str, ...] = ()) -> None:
    """Make ``layer`` hold ``fresh``'s files: the bound directories (``BOUND``, and ``mounted``: the layer paths
    of the template's shared directories bound over it, with each one's parents) stay, since the running
    sandbox's mounts point at them, and their entries are moved; anything else is renamed whole. What was there
    goes to ``trash``."""
    stay = set(BOUND)
    for rel in mounted:
        parts = rel.split("/")
        stay.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    trash.mkdir(exist_ok=True)
    _swap(layer, fresh, trash, "", stay)
    shutil.rmtree(fresh, ignore_errors=True)


def _swap(cur_dir: Path, new_dir: Path, trash: Path, rel: str, stay: set[str]) -> None:
    for name in sorted({p.name for p in cur_dir.iterdir()} | {p.name for p in new_dir.iterdir()}):
        cur, new, r = cur_dir / name, new_dir / name, f"{rel}/{name}" if rel else name
        if r in stay and cur.is_dir() and not cur.is_symlink() and new.is_dir() and not new.is_symlink():
            held = trash / name
            held.mkdir(exist_ok=True)
            _swap(cur, new, held, r, stay)
            st = new.stat()
            os.chmod(cur, st.st_mode & 0o7777)
            os.utime(cur, ns=(st.st_atime_ns, st.st_mtime_ns))
            continue
        if cur.exists() or cur.is_symlink():
            os.rename(cur, trash / (name if rel else f"{name}.old"))
        if new.exists() or new.is_symlink():
            os.rename(new, cur)
