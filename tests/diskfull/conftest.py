"""A small filesystem of its own under `moorage up`'s data directory, which a test fills up and frees again.

A tmpfs of a few MiB fills in milliseconds and answers ENOSPC like any full disk (the host's log stays outside it,
so the host can still say what happened). Mounting needs root, as the micro-VM and process drivers' tests do."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.postgres import free_port
from tests.lifecycle.crash_up import Up, stop_sandboxes
from tests.lifecycle.test_crash_operations import _guests_of

GZ = {"content-type": "application/gzip"}

#: An agent that counts its turns in a file of its disk (its previous state, which nothing may lose) and, asked
#: ``fill N [after S]``, writes N MiB to its disk (and syncs them), S seconds into the turn (an event first).
AGENT = '''
import asyncio, os

async def on_message(ctx, message):
    if message.startswith("fill "):
        words = message.split()
        if len(words) == 4:
            await ctx.emit("waiting", words[3])  # a stream has begun
            await asyncio.sleep(float(words[3]))
        with open("big.bin", "ab") as f:
            for _ in range(int(words[1])):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        return "filled"
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def archive(version: str = "1", disk_mib: int = 4) -> bytes:
    """The counting agent as the tar.gz a deploy uploads (a small ``disk_mib``: the data disk is small too)."""
    files = {"moorage.toml": f'[agent]\nname = "echo"\nentry = "agent.py"\ndisk_mib = {disk_mib}\n'
                             '[agent.lifecycle]\nusers = "auto"\n',
             "agent.py": AGENT + f"# version {version}\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class SmallDisk:
    """A tmpfs of ``size_mib`` mounted at ``path``; ``fill()`` takes every byte left, ``free()`` gives it back."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
        self.filler = path / "filler"

    def fill(self) -> None:
        deadline = time.monotonic() + 10
        with open(self.filler, "ab", buffering=0) as f:
            # The host may free a block meanwhile (a file it removes; a page it holds a moment, as CI once saw
            # after twenty tries in a row): fill that too, for up to ten seconds.
            while True:
                for block in (1 << 20, 4096, 1):  # down to the last byte
                    try:
                        while True:
                            f.write(b"\0" * block)
                    except OSError:
                        pass
                if os.statvfs(self.path).f_bavail == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        # A page the kernel counts as free is not always one a write can take: CI once saw ``f_bfree == 1`` for the
        # whole ten seconds while every write failed. The disk is full for every write all the same.
        assert os.statvfs(self.path).f_bavail <= 1

    def leave(self, nbytes: int) -> None:
        """Full but for ``nbytes``: room for a small write (SQLite's, into its WAL), none for a large one."""
        self.fill()
        os.truncate(self.filler, os.path.getsize(self.filler) - nbytes)

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)


@contextlib.contextmanager
def up_on_small_disk(tmp_path: Path, driver: str, size_mib: int) -> Iterator[tuple[Up, SmallDisk]]:
    """`moorage up` (not started yet) whose data directory is a small disk; its log is outside it
    (``tmp_path/up.log``). Everything it started is stopped and the disk unmounted afterwards."""
    disk = SmallDisk(tmp_path / "data", size_mib)
    u = Up(disk.path, free_port(), driver)
    try:
        yield u, disk
    finally:
        u.stop()
        if driver == "process":
            stop_sandboxes(u.data)
        for pid in _guests_of(u.data / "sandboxes"):  # a micro-VM outlives its host by design
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # the killed guests let go of their files on the disk
        disk.unmount()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[Up, SmallDisk]]:
    """`moorage up` with the process driver on a 32 MiB disk."""
    with up_on_small_disk(tmp_path, "process", 32) as both:
        yield both


@pytest.fixture
def vm_host(tmp_path: Path) -> Iterator[tuple[Up, SmallDisk]]:
    """`moorage up` with the micro-VM driver on a 512 MiB disk (a template's memory image takes ~100 MiB of it)."""
    with up_on_small_disk(tmp_path, "microvm", 512) as both:
        yield both
