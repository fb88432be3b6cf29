"""Process-driver specifics: namespaces and limits it declares, crash recovery, and a hostile guest on adoption."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.errors import ConflictError, InvalidInput
from moorage.sandbox import SandboxSpec, SandboxState, SandboxStateError
from moorage.sandbox.process import ProcessDriver, ProcessSandbox
from moorage.sandbox import process_limits


@pytest.fixture
async def pdriver(tmp_path: Path):
    d = ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
    yield d
    await d.close()
    cleaner = ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()


def test_capabilities_are_honest(pdriver: ProcessDriver) -> None:
    caps = pdriver.capabilities
    assert not caps.keeps_processes_across_sleep and not caps.memory_snapshot and not caps.own_kernel
    assert caps.network_isolated
    assert {"file_size", "disk", "memory"} <= caps.enforced_limits
    support = process_limits.detect()
    assert ("processes" in caps.enforced_limits) == bool(support.cgroup)


async def test_namespaces_user_and_readonly_root(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("ns")
    await sb.start()
    r = await sb.exec(["/bin/sh", "-c", "id -u; hostname; echo $$; touch /usr/x 2>/dev/null && echo WROTE-USR; "
                      "ls /proc | grep -c '^[0-9]' ; cat /proc/net/dev | grep -c ':'"])
    uid, host, pid, nprocs, nifs = r.stdout_text.split()
    assert uid == "1000" and host == "sandbox"
    assert int(pid) < 50  # own pid namespace: low pids, host processes invisible
    assert "WROTE-USR" not in r.stdout_text
    assert int(nifs) == 1  # only the namespace's own loopback


async def test_supervisor_crash_becomes_stopped_and_wakes(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("crash")
    await sb.start()
    await sb.write_file("kept.txt", b"on disk")
    assert isinstance(sb, ProcessSandbox) and sb._pid
    os.killpg(sb._pid, signal.SIGKILL)
    for _ in range(200):
        if sb.state is SandboxState.STOPPED:
            break
        await asyncio.sleep(0.05)
    assert sb.state is SandboxState.STOPPED
    with pytest.raises(SandboxStateError):
        await sb.exec(["true"])
    await sb.wake()
    assert await sb.read_file("kept.txt") == b"on disk"


async def test_adopting_a_dead_sandbox_reports_stopped(pdriver: ProcessDriver, tmp_path: Path) -> None:
    sb = await pdriver.create("dead")
    await sb.start()
    assert isinstance(sb, ProcessSandbox)
    pid = sb._pid
    os.killpg(pid, signal.SIGKILL)
    await asyncio.get_running_loop().run_in_executor(None, sb._proc.wait)  # type: ignore[union-attr]
    meta = json.loads((sb.dir / "meta.json").read_text())
    assert meta["state"] == "running"  # the host "crashed" before noticing
    fresh = ProcessDriver(pdriver.root, Config(data_dir=tmp_path))
    again = await fresh.open("dead")
    assert again.state is SandboxState.STOPPED
    assert isinstance(again, ProcessSandbox)
    # Its cgroup outlived it (the host that would have removed it "crashed"); adoption removes it.
    assert not [d for d in again.cgroup.dirs if d.exists()]
    await again.wake()
    assert (await again.ping())["pong"]
    await fresh.close()


async def test_hostile_guest_on_the_socket_is_rejected_on_adoption(pdriver: ProcessDriver, tmp_path: Path) -> None:
    """A guest process steals the channel socket path and answers the next host connection with garbage."""
    sb = await pdriver.create("hostile")
    await sb.start()
    impostor = r"""
import os, socket, struct, time
path = "/run/moorage/chan.sock"
os.unlink(path)
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(8)
open("/work/impostor.ready", "w").close()
while True:
    c, _ = srv.accept()
    c.recv(65536)
    bad = b"{garbage"
    c.sendall(struct.pack(">I", len(bad)) + bad)
    c.sendall(struct.pack(">I", 0x7FFFFFFF) + b"xx")
    c.close()
"""
    await sb.write_file("impostor.py", impostor.encode())
    await sb.exec(["/bin/sh", "-c", "nohup python3 impostor.py >/dev/null 2>&1 &"])
    for _ in range(200):
        if await sb.stat("impostor.ready") is not None:
            break
        await asyncio.sleep(0.05)
    fresh = ProcessDriver(pdriver.root, Config(data_dir=tmp_path))
    again = await fresh.open("hostile")  # must not raise or hang: the host stops the sandbox instead
    assert again.state is SandboxState.STOPPED
    await again.wake()  # a clean boot replaces the socket and the impostor is gone with the old processes
    assert (await again.exec(["cat", "impostor.ready"])).exit_code == 0
    assert (await again.ping())["pong"]
    await fresh.close()


async def test_disk_quota_kills_workers_not_the_supervisor(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("quota", SandboxSpec(disk_mib=8))
    await sb.start()
    # At most 512 MiB in fsynced 1 MiB files: far past the 8 MiB quota, bounded if the watchdog were broken.
    fill = "import os\nos.mkdir('big')\nfor i in range(512):\n with open('big/%d' % i, 'wb') as f:\n  f.write(b'z'*(1<<20)); f.flush(); os.fsync(f.fileno())"
    r = await sb.exec(["python3", "-c", fill], timeout=60)
    assert r.exit_code == -signal.SIGKILL
    assert isinstance(sb, ProcessSandbox) and sb.quota_exceeded
    assert sb.state is SandboxState.RUNNING
    await sb.exec(["rm", "-r", "big"])
    assert (await sb.exec(["echo", "ok"])).stdout == b"ok\n"


async def test_ids_limits_and_duplicates_are_validated(pdriver: ProcessDriver) -> None:
    for bad in ["../escape", "UPPER", "", "a/b", ".hidden"]:
        with pytest.raises(InvalidInput):
            await pdriver.create(bad)
    with pytest.raises(InvalidInput):
        await pdriver.create("tiny", SandboxSpec(max_processes=1))
    await pdriver.create("dup")
    with pytest.raises(ConflictError):
        await pdriver.create("dup")
    sb = await pdriver.open("dup")
    with pytest.raises(SandboxStateError):
        await sb.sleep()  # never started


async def test_host_environment_is_not_passed(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("env")
    assert isinstance(sb, ProcessSandbox)
    argv = pdriver.bwrap_argv(sb)
    assert "--clearenv" in argv and "--unshare-all" in argv and "--die-with-parent" in argv
    assert "--share-net" not in argv


def test_get_driver_picks_process_when_asked(tmp_path: Path) -> None:
    from moorage.errors import ConfigError
    from moorage.sandbox import get_driver

    d = get_driver(Config(data_dir=tmp_path, sandbox_driver="process"))
    assert isinstance(d, ProcessDriver) and d.root == tmp_path / "sandboxes"
    with pytest.raises(ConfigError):
        get_driver(Config(data_dir=tmp_path, sandbox_driver="teleport"))
