"""A small filesystem of its own under `moorage up`'s data directory, which a test fills up and frees again.

A tmpfs of a few MiB fills in milliseconds and answers ENOSPC like any full disk (the host's log stays outside it,
so the host can still say what happened). Mounting needs root, as the micro-VM and process drivers' tests do."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.postgres import free_port
from tests.lifecycle.crash_up import Up
from tests.runtime.test_mustshow_crash import stop_sandboxes

GZ = {"content-type": "application/gzip"}

#: An agent that counts its turns in a file of its disk (its previous state, which nothing may lose) and writes
#: ``fill N`` MiB to its disk when asked.
AGENT = '''
async def on_message(ctx, message):
    if message.startswith("fill "):
        with open("big.bin", "ab") as f:
            for _ in range(int(message.split()[1])):
                f.write(b"x" * (1 << 20))
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
        with open(self.filler, "ab", buffering=0) as f:
            for block in (1 << 20, 4096, 1):  # down to the last byte
                try:
                    while True:
                        f.write(b"\0" * block)
                except OSError:
                    pass
        assert os.statvfs(self.path).f_bavail == 0

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    d = SmallDisk(tmp_path / "data", 32)
    try:
        yield d
    finally:
        d.unmount()


@pytest.fixture
def up(disk: SmallDisk) -> Iterator[Up]:
    """`moorage up` (process driver) on the small disk; its log is outside it (``tmp_path/up.log``)."""
    u = Up(disk.path, free_port(), "process")
    try:
        yield u
    finally:
        u.stop()
        stop_sandboxes(u.data)
