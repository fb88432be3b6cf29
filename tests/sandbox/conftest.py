"""Fixtures for sandbox tests: a real guest supervisor on a socketpair, and one factory per sandbox driver.

``DRIVER_FACTORIES`` maps a driver name to a factory ``(root, config) -> SandboxDriver``; the conformance suite
runs against every entry. A driver adds itself by adding an entry (the microvm driver does).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest

from moorage.config import Config
from moorage.sandbox import SandboxDriver, guest_source_dir
from moorage.sandbox.channel import Channel

#: The guest must run on the Debian system interpreter, stdlib only (as it does inside a sandbox image).
SYSTEM_PYTHON = "/usr/bin/python3"

DriverFactory = Callable[[Path, Config], SandboxDriver]


def _process_driver(root: Path, config: Config) -> SandboxDriver:
    from moorage.sandbox.process import ProcessDriver

    return ProcessDriver(root, config)


def _microvm_driver(root: Path, config: Config) -> SandboxDriver:
    from moorage.sandbox.microvm import MicroVMDriver

    # One guest image cache for every test (building it, debootstrap included, is the slow part).
    images = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
    return MicroVMDriver(root, config, images_dir=images)


DRIVER_FACTORIES: dict[str, DriverFactory] = {
    "process": _process_driver,
    "microvm": _microvm_driver,
}


def require(condition: bool, what: str) -> None:
    """A missing prerequisite fails loudly (CI never skips)."""
    if not condition:
        pytest.fail(f"prerequisite missing: {what} (run scripts/bootstrap.sh)")


@pytest.fixture
def guest_copy(tmp_path: Path) -> Path:
    """A copy of the guest package as a driver would place it in a sandbox: <dir>/guest."""
    require(os.access(SYSTEM_PYTHON, os.X_OK), SYSTEM_PYTHON)
    dest = tmp_path / "opt" / "guest"
    shutil.copytree(guest_source_dir(), dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


class GuestProcess:
    """A supervisor child process connected to a host Channel over a socketpair."""

    def __init__(self, proc: subprocess.Popen[bytes], channel: Channel, workdir: Path) -> None:
        self.proc = proc
        self.channel = channel
        self.workdir = workdir


@pytest.fixture
async def start_guest(guest_copy: Path, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[GuestProcess]]]:
    started: list[GuestProcess] = []

    async def start(*extensions: str, env: dict[str, str] | None = None) -> GuestProcess:
        workdir = tmp_path / f"work{len(started)}"
        workdir.mkdir()
        host_sock, guest_sock = socket.socketpair()
        argv = [SYSTEM_PYTHON, "-I", str(guest_copy), "--fd", str(guest_sock.fileno()), "--workdir", str(workdir)]
        for e in extensions:
            argv += ["--extension", e]
        proc = subprocess.Popen(
            argv,
            pass_fds=[guest_sock.fileno()],
            env={"PATH": "/usr/bin:/bin", "HOME": str(workdir), **(env or {})},
            stderr=subprocess.PIPE,
        )
        guest_sock.close()
        reader, writer = await asyncio.open_connection(sock=host_sock)
        ch = Channel(reader, writer, name="test-guest")
        ch.start()
        g = GuestProcess(proc, ch, workdir)
        started.append(g)
        return g

    yield start
    for g in started:
        await g.channel.close()
        g.proc.kill()
        g.proc.wait()
        if g.proc.stderr:
            g.proc.stderr.close()


@pytest.fixture(params=sorted(DRIVER_FACTORIES))
async def make_driver(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Callable[[], SandboxDriver]]:
    """Builds driver instances on one root; a second call is "the host after a restart" (same disk, new process state)."""
    factory = DRIVER_FACTORIES[request.param]
    root = tmp_path / "sandboxes"
    cfg = Config(data_dir=tmp_path / "data")
    made: list[SandboxDriver] = []

    def make() -> SandboxDriver:
        d = factory(root, cfg)
        made.append(d)
        return d

    yield make
    # Tear down every sandbox left behind so no process outlives the test.
    cleaner = factory(root, cfg)
    for d in made:
        await d.close()
    for sid in await cleaner.list():
        sb = await cleaner.open(sid)
        await sb.destroy()


@pytest.fixture
def driver(make_driver: Callable[[], SandboxDriver]) -> SandboxDriver:
    return make_driver()
