"""Neighbour fairness: each sandbox's CPU share (cgroups, both drivers) and a channel reader that hands the host's
event loop back while a flooding guest's frames are still buffered."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path
import pytest

from moorage.config import Config
from moorage.sandbox import SandboxSpec, cgroups
from moorage.sandbox.channel import Channel
from moorage.sandbox.process import ProcessDriver, ProcessSandbox

from .test_microvm import make_driver as make_microvm_driver

HOST_HYBRID_MOUNTINFO = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
"""
HOST_HYBRID_CGROUP = "5:pids:/system.slice/moorage.service\n3:cpu,cpuacct:/system.slice/moorage.service\n0::/system.slice/moorage.service\n"
SYSTEMD_V2_MOUNTINFO = "31 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
SYSTEMD_V2_CGROUP = "0::/system.slice/moorage.service\n"


def test_cgroup_mounts_are_found_on_hybrid_and_pure_v2_hosts() -> None:
    v2, v1 = cgroups.parse_mounts(HOST_HYBRID_MOUNTINFO, HOST_HYBRID_CGROUP)
    assert v2 == cgroups.Mount(Path("/sys/fs/cgroup/unified"), "/system.slice/moorage.service")
    assert v1 == cgroups.Mount(Path("/sys/fs/cgroup/cpu,cpuacct"), "/system.slice/moorage.service")
    assert v1.own_dir == Path("/sys/fs/cgroup/cpu,cpuacct/system.slice/moorage.service")
    v2, v1 = cgroups.parse_mounts(SYSTEMD_V2_MOUNTINFO, SYSTEMD_V2_CGROUP)
    assert v2 is not None and v2.own_dir == Path("/sys/fs/cgroup/system.slice/moorage.service")
    assert v1 is None
    # This host, as it is: whatever it offers, the answer is consistent with what the driver declares.
    control = cgroups.cpu_control()
    assert control.kind in ("v2", "v1", "")
    assert (control.parent is not None) == bool(control.kind)


def test_the_tightest_cpu_quota_on_the_path_is_read_from_v2_and_v1_files(tmp_path: Path) -> None:
    """The kernel's own formats, laid out as a pure v2 host (``cpu.max``) and a v1 one (``cpu.cfs_*``) show them;
    this host's real cgroups are in tests/llm/test_engine_threads.py."""
    v2 = cgroups.Mount(tmp_path / "v2", "/system.slice/moorage.service")
    v2.own_dir.mkdir(parents=True)
    (v2.root / "system.slice" / "cpu.max").write_text("150000 100000\n")  # CPUQuota=150% on the slice
    (v2.own_dir / "cpu.max").write_text("max 100000\n")  # none on the unit itself
    assert cgroups.cpu_quota(v2, None) == 1.5
    (v2.own_dir / "cpu.max").write_text("50000 100000\n")
    assert cgroups.cpu_quota(v2, None) == 0.5
    v1 = cgroups.Mount(tmp_path / "v1", "/docker/abc")
    v1.own_dir.mkdir(parents=True)
    (v1.own_dir / "cpu.cfs_quota_us").write_text("-1\n")
    (v1.own_dir / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroups.cpu_quota(None, v1) is None
    (v1.own_dir / "cpu.cfs_quota_us").write_text("200000\n")
    assert cgroups.cpu_quota(None, v1) == 2.0
    assert cgroups.cpu_quota(v2, v1) == 0.5  # both bind
    assert cgroups.cpu_quota(None, None) is None


def _cgroup_lines(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


def _in_cpu_cgroup(pid: int, d: Path) -> bool:
    """Is ``pid`` a member of cgroup directory ``d`` (v1 or v2)?"""
    try:
        return str(pid) in (d / "cgroup.procs").read_text().split()
    except OSError:
        return False


@pytest.fixture
async def pdriver(tmp_path: Path):
    d = ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
    yield d
    await d.close()
    cleaner = ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()


async def test_every_process_of_a_process_sandbox_has_the_sandboxs_cpu_share(pdriver: ProcessDriver) -> None:
    control = pdriver.limit_support.cpu
    sb = await pdriver.create("cpu", SandboxSpec(vcpus=1))
    assert isinstance(sb, ProcessSandbox)
    await sb.start()
    r = await sb.exec(["/bin/sh", "-c", "sleep 30 & echo started"])
    assert "started" in r.stdout_text
    d = control.dir_for(sb.cgroup.name)
    if not control.kind:
        # A host without CPU control: the driver does not claim one.
        assert "cpu" not in pdriver.capabilities.enforced_limits and d is None
        return
    assert "cpu" in pdriver.capabilities.enforced_limits
    assert d is not None and d in sb.cgroup.dirs
    tree = [sb._pid, *[p for p in sb.cgroup.pids()]]
    assert len(tree) >= 3  # the supervisor's tree and the background sleep
    assert all(_in_cpu_cgroup(p, d) for p in set(tree) if Path(f"/proc/{p}").exists())
    settings = control.settings(sb.cgroup.name)
    if control.kind == "v2":
        assert settings == {"cpu.weight": str(cgroups.SANDBOX_WEIGHT), "cpu.max": f"{cgroups.PERIOD_US} {cgroups.PERIOD_US}"}
    else:
        assert settings == {"cpu.shares": "1024", "cpu.cfs_quota_us": str(cgroups.PERIOD_US),
                            "cpu.cfs_period_us": str(cgroups.PERIOD_US)}
    await sb.destroy()
    assert not d.exists()


async def test_a_qemu_runs_in_its_own_cpu_cgroup_removed_when_it_stops(tmp_path: Path) -> None:
    driver = make_microvm_driver(tmp_path / "sandboxes")
    control = cgroups.cpu_control()
    try:
        sb = await driver.create("vm-cpu", SandboxSpec(vcpus=1))
        await sb.start()
        pid = sb.pid
        assert pid
        groups = [line.split(":", 2)[2] for line in _cgroup_lines(pid).splitlines()
                  if line.split(":", 2)[1] in ("", "cpu", "cpu,cpuacct", "cpuacct,cpu")]
        if not control.kind:
            assert not any("vm-" in g for g in groups)
            return
        assert control.parent is not None
        (d,) = [p for p in control.parent.iterdir() if p.is_dir() and _in_cpu_cgroup(pid, p)]
        assert d.name.startswith("vm-")
        quota = int((1 + 0.5) * cgroups.PERIOD_US)  # one vCPU plus the emulator's threads
        want = ({"cpu.weight": str(cgroups.SANDBOX_WEIGHT), "cpu.max": f"{quota} {cgroups.PERIOD_US}"}
                if control.kind == "v2" else
                {"cpu.shares": "1024", "cpu.cfs_quota_us": str(quota), "cpu.cfs_period_us": str(cgroups.PERIOD_US)})
        assert control.settings(d.name) == want
        assert (await sb.exec(["true"])).exit_code == 0
        await sb.stop()
        for _ in range(100):  # removed by a thread that waits for QEMU's exit
            if not d.exists():
                break
            await asyncio.sleep(0.05)
        assert not d.exists()
    finally:
        for sid in await driver.list():
            await (await driver.open(sid)).destroy()
        await driver.close()


async def test_a_flooding_channel_hands_the_loop_back_between_large_frames() -> None:
    """A guest whose frames are all buffered already (read without the reader ever suspending): the reader must
    yield to other tasks as it goes, here after every frame (each costs more than its slice), not read them all."""
    host_sock, guest_sock = socket.socketpair()
    _, w = await asyncio.open_connection(sock=host_sock)
    buffered = asyncio.StreamReader(limit=64 << 20)
    ch = Channel(buffered, w, name="flood")
    ch.start()
    gr, gw = await asyncio.open_connection(sock=guest_sock)
    frames = 8  # 8 x 3 MiB stays under the call's 32 MiB of unread events: no backpressure in this test
    big = {"pad": "x" * (3 << 20), "nested": [{"k": i} for i in range(2000)]}
    try:
        stream = ch.stream("produce")
        await stream._begin()
        (n,) = struct.unpack(">I", await gr.readexactly(4))
        rid = json.loads(await gr.readexactly(n))["id"]
        payload = b"".join(struct.pack(">I", len(p)) + p for p in (
            json.dumps({"id": rid, "event": "tick", "data": {"i": i, **big}}).encode() for i in range(frames)))
        done = json.dumps({"id": rid, "result": "done"}).encode()
        buffered.feed_data(payload + struct.pack(">I", len(done)) + done)
        pending = stream._pending
        assert pending is not None
        # A ticker on the same loop: how many events arrived between two of its turns.
        seen: list[int] = [0]
        while not pending.future.done():
            await asyncio.sleep(0)
            seen.append(pending.events.qsize())
        bursts = [b - a for a, b in zip(seen, seen[1:])]
        assert max(bursts) <= 1, bursts  # never a run of frames without the loop coming back
        got = [ev async for ev in stream]
        assert len(got) == frames and stream.result == "done"
    finally:
        await ch.close()
        gw.close()


async def test_a_guest_that_keeps_sending_gets_its_frames_read_at_the_readers_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a burst, a reader takes at most READ_FRAMES_PER_S frames a second from one guest however fast they come
    (each frame costs the host more than its decoding): the rest wait in the socket, the guest waits on them."""
    from moorage.sandbox import channel as channel_mod

    monkeypatch.setattr(channel_mod, "READ_FRAMES_PER_S", 200)
    monkeypatch.setattr(channel_mod, "READ_BURST_FRAMES", 100)
    host_sock, guest_sock = socket.socketpair()
    r, w = await asyncio.open_connection(sock=host_sock)
    ch = Channel(r, w, name="rate")
    ch.start()
    gr, gw = await asyncio.open_connection(sock=guest_sock)
    frames = 400
    try:
        stream = ch.stream("produce")
        await stream._begin()
        (n,) = struct.unpack(">I", await gr.readexactly(4))
        rid = json.loads(await gr.readexactly(n))["id"]
        started = asyncio.get_running_loop().time()
        for i in range(frames):
            p = json.dumps({"id": rid, "event": "tick", "data": i}).encode()
            gw.write(struct.pack(">I", len(p)) + p)
        done = json.dumps({"id": rid, "result": "done"}).encode()
        gw.write(struct.pack(">I", len(done)) + done)
        await gw.drain()
        got = [ev.data async for ev in stream]
        elapsed = asyncio.get_running_loop().time() - started
        assert got == list(range(frames)) and stream.result == "done"  # all of them, in order
        # 100 at once, then 200 a second (checked every 64 frames, so up to 63 more go free): the other 237 take at
        # least 1.18 s, where the reader alone takes ~10 ms (a lower bound: a slow host only adds to it).
        assert elapsed >= 1.1, elapsed
    finally:
        await ch.close()
        gw.close()
