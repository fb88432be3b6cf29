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


THREADS = r"""
import sys, threading, time
started = []
def work():
    held = [bytearray(2000) for _ in range(200)]  # a little heap in each thread (its own malloc arena, unbounded)
    started.append(len(held))
    time.sleep(2)
for i in range(int(sys.argv[1])):
    threading.Thread(target=work).start()
time.sleep(0.5)
print(len(started))
"""


@pytest.mark.parametrize("support", ["host", "rlimits only"])
async def test_a_thread_per_connection_program_gets_the_threads_its_memory_allows(pdriver: ProcessDriver,
                                                                                 support: str) -> None:
    # Address space reserved per thread (an 8 MiB stack, a 64 MiB malloc arena) is not memory used: a 256 MiB
    # sandbox runs a server with a thread per connection past the app relay's 32 sockets. Without a cgroup,
    # RLIMIT_AS is the bound, stacks count in full and malloc's arenas are capped (MALLOC_ARENA_MAX).
    if support == "rlimits only":
        pdriver.limit_support = process_limits.LimitSupport("")
    want = 48 if pdriver.limit_support.cgroup else 16
    sb = await pdriver.create("threads", SandboxSpec(memory_mib=256))
    await sb.start()
    await sb.write_file("threads.py", THREADS.encode())
    r = await sb.exec(["python3", "threads.py", str(want)], timeout=60)
    assert r.exit_code == 0 and r.stdout.strip() == str(want).encode(), r


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


def test_auto_never_falls_back_to_the_process_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.errors import ConfigError
    from moorage.sandbox import get_driver

    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a host without QEMU
    with pytest.raises(ConfigError) as e:
        get_driver(Config(data_dir=tmp_path, sandbox_driver="auto"))
    assert "QEMU" in str(e.value) and 'sandbox_driver = "process"' in (e.value.hint or "")


#: Each line tries one kernel surface from inside the sandbox and prints what happened.
SURFACES = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def sys(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, "OK" if r >= 0 else errno.errorcode[ctypes.get_errno()])
sys("unshare-user", 272, 0x10000000)
sys("unshare-net", 272, 0x40000000)
sys("clone-newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
sys("io_uring_setup", 425, 8, ctypes.create_string_buffer(120))
sys("keyctl", 250, 0, 0, 0)
sys("bpf", 321, 0, 0, 0)
sys("perf_event_open", 298, 0, 0, -1, -1, 0)
sys("userfaultfd", 323, 0)
sys("ptrace", 101, 0, 1, 0, 0)
sys("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
for name, fam, kind, proto in [("packet", 17, socket.SOCK_RAW, 0), ("raw-icmp", socket.AF_INET, socket.SOCK_RAW, 1),
                               ("alg", 38, socket.SOCK_SEQPACKET, 0)]:
    try:
        socket.socket(fam, kind, proto).close(); print(name, "OK")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
print("uid", os.getuid(), "userns-max", open("/proc/sys/user/max_user_namespaces").read().strip())
"""


async def test_kernel_surfaces_are_filtered(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("seccomp")
    await sb.start()
    await sb.write_file("/work/surfaces.py", SURFACES.encode())
    r = await sb.exec(["python3", "/work/surfaces.py"])
    got = dict(line.split(" ", 1) for line in r.stdout_text.strip().splitlines())
    assert r.ok, r.stderr_text
    for name in ("unshare-user", "unshare-net", "clone-newuser", "io_uring_setup", "keyctl", "bpf", "perf_event_open",
                 "userfaultfd", "ptrace", "mount", "raw-icmp"):
        assert got[name] == "EPERM", (name, got)
    assert got["packet"] == "EAFNOSUPPORT" and got["alg"] == "EAFNOSUPPORT", got
    assert got["uid"].startswith("1000 ")
    # Ordinary work still runs under the filter: processes, threads, files, loopback sockets.
    ok = await sb.exec(["sh", "-c", "python3 -c 'import threading, socket; t = threading.Thread(target=print); t.start();"
                        " t.join(); s = socket.socket(); s.bind((\"127.0.0.1\", 0)); s.listen()' && echo fine > f && cat f"])
    assert ok.ok and ok.stdout_text.strip() == "fine", ok.stderr_text


async def test_sandbox_processes_run_as_an_unprivileged_host_uid(pdriver: ProcessDriver) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test checks the uid drop a root host makes; run the suite as root (scripts/test.sh)")
    sb = await pdriver.create("uid")
    await sb.start()
    assert isinstance(sb, ProcessSandbox)
    await sb.exec(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo started"])  # not holding the reply open
    uids = {}
    for pid in [sb._pid or 0, *process_limits.descendants(sb._pid or 0)]:
        status = Path(f"/proc/{pid}/status").read_text()
        uids[pid] = {int(x) for x in next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1:]}
    # The launcher's root shells exec'd into bubblewrap: every process of the sandbox, bubblewrap included,
    # runs as the sandbox uid (real, effective, saved and filesystem uid alike).
    assert len(uids) >= 3 and all(u == {pdriver.config.sandbox_uid} for u in uids.values()), uids
    # Its files on the host are the sandbox uid's, inside directories only the host can enter.
    assert (sb.layer / "work").stat().st_uid == pdriver.config.sandbox_uid
    assert oct(sb.dir.stat().st_mode & 0o777) == "0o700" and oct(pdriver.root.stat().st_mode & 0o777) == "0o700"
    assert oct((sb.dir / "meta.json").stat().st_mode & 0o777) == "0o600"


async def test_the_guest_package_is_byte_compiled_for_the_supervisors_interpreter(pdriver: ProcessDriver) -> None:
    # The package is mounted read-only: without bytecode made on the host, every supervisor start (each wake and
    # rollback) would compile the modules it imports again. Checked from inside, with the sandbox's interpreter.
    sb = await pdriver.create("pyc")
    await sb.start()
    check = (
        "import importlib.util, os, struct\n"
        "bad = []\n"
        "g = '/opt/moorage/guest'\n"
        "for n in sorted(os.listdir(g)):\n"
        "    if not n.endswith('.py') or n == '__main__.py':\n"
        "        continue\n"
        "    src = os.path.join(g, n)\n"
        "    pyc = importlib.util.cache_from_source(src)\n"
        "    try:\n"
        "        head = open(pyc, 'rb').read(16)\n"
        "    except OSError:\n"
        "        bad.append(n); continue\n"
        "    st = os.stat(src)\n"
        "    magic, flags, mtime, size = head[:4], *struct.unpack('<III', head[4:])\n"
        "    if magic != importlib.util.MAGIC_NUMBER or flags or mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size:\n"
        "        bad.append(n)\n"
        "print('stale:', bad)\n")
    r = await sb.exec(["/usr/bin/python3", "-I", "-c", check])
    assert r.exit_code == 0, r.stderr_text
    assert r.stdout_text.strip() == "stale: []"


async def test_a_rollback_interrupted_by_a_host_stop_leaves_nothing_behind_after_the_next_boot(pdriver: ProcessDriver) -> None:
    sb = await pdriver.create("leftover")
    await sb.start()
    await sb.write_file("/work/a.txt", b"one")
    await sb.checkpoint("c1")
    await sb.write_file("/work/a.txt", b"two")
    await sb.rollback("c1")
    assert await sb.read_file("/work/a.txt") == b"one"
    # What a host stopped mid-rollback leaves: a half-made copy and a replaced layer, hidden in the sandbox dir.
    for name in (".layer-rollback-dead0001", ".layer-old-dead0002"):
        (sb.dir / name / "work").mkdir(parents=True)
        (sb.dir / name / "work" / "big.bin").write_bytes(b"x" * 4096)
    await sb.sleep()
    await sb.wake()
    for _ in range(100):
        if not [p for p in sb.dir.iterdir() if p.name.startswith(".layer-")]:
            break
        await asyncio.sleep(0.05)
    assert [p.name for p in sb.dir.iterdir() if p.name.startswith(".layer-")] == []
    assert await sb.read_file("/work/a.txt") == b"one"


async def test_a_rollback_of_a_running_sandbox_restarts_the_agent_inside_the_same_sandbox(pdriver: ProcessDriver) -> None:
    # The zygote (the sandbox's first process) forks a fresh supervisor: the sandbox and its namespaces stay,
    # every process the agent had is gone, the files are the checkpoint's, and the supervisor never holds the
    # zygote's control socket.
    sb = await pdriver.create("inplace")
    await sb.start()
    await sb.write_file("/work/a.txt", b"one")
    await sb.checkpoint("c1")
    await sb.write_file("/work/a.txt", b"two")
    await sb.write_file("/work/b.txt", b"later")
    await sb.write_file("/tmp/t.txt", b"tmp")
    who = ("import os\n"
           "sup = os.getppid()\n"
           "zyg = int(open(f'/proc/{sup}/stat').read().rsplit(')', 1)[1].split()[1])\n"
           "argv = open(f'/proc/{zyg}/cmdline', 'rb').read().split(b'\\0')\n"
           "n = argv[argv.index(b'--zygote-fd') + 1].decode()\n"
           "print(sup, zyg, os.path.exists(f'/proc/{sup}/fd/{n}'), os.path.exists(f'/proc/self/fd/{n}'))\n")
    before = (await sb.exec(["/usr/bin/python3", "-I", "-c", who])).stdout_text.split()
    # A daemon the agent left behind (its own session, reparented to the sandbox's init once its parent exits).
    await sb.exec(["/bin/sh", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo started"])
    running = (await sb.exec(["/bin/sh", "-c", "ls /tmp; ps -eo comm"])).stdout_text.split()
    assert "sleep" in running and "t.txt" in running
    host_pid = sb._pid  # type: ignore[attr-defined]
    await sb.rollback("c1")
    after = (await sb.exec(["/usr/bin/python3", "-I", "-c", who])).stdout_text.split()
    assert sb._pid == host_pid  # type: ignore[attr-defined]  # the same sandbox, not a new one
    assert after[1] == before[1] and after[0] != before[0]  # same zygote, a new supervisor
    assert before[2:] == after[2:] == ["False", "False"]  # the control socket stays the zygote's
    assert await sb.read_file("/work/a.txt") == b"one"
    names = (await sb.exec(["/bin/sh", "-c", "ls /work /tmp; ps -eo comm"])).stdout_text.split()
    assert "b.txt" not in names and "t.txt" not in names and "sleep" not in names
    await sb.write_file("/work/c.txt", b"after")  # the restored layer is the agent's to write
    await sb.sleep()
    await sb.wake()
    assert await sb.read_file("/work/a.txt") == b"one" and await sb.read_file("/work/c.txt") == b"after"


async def test_a_sandbox_outlives_its_zygotes_control_socket_and_still_rolls_back(pdriver: ProcessDriver) -> None:
    # The host's end closing (a handle on the sandbox dropped; a host that exits takes the sandbox with it anyway)
    # does not stop the agent; a rollback then restarts the sandbox the slow way.
    sb = await pdriver.create("ctlgone")
    await sb.start()
    await sb.write_file("/work/a.txt", b"one")
    await sb.checkpoint("c1")
    await sb.write_file("/work/a.txt", b"two")
    sb._zygote.close()  # type: ignore[attr-defined]
    await asyncio.sleep(0.2)
    assert (await sb.exec(["/bin/echo", "alive"])).stdout_text.strip() == "alive"
    host_pid = sb._pid  # type: ignore[attr-defined]
    await sb.rollback("c1")
    assert await sb.read_file("/work/a.txt") == b"one"
    assert sb._pid != host_pid  # type: ignore[attr-defined]  # a new sandbox this time


async def test_a_slept_sandbox_is_destroyed_at_once(pdriver: ProcessDriver) -> None:
    """After a sleep the record names no supervisor start time; a gone supervisor was read as alive then (None ==
    None), and destroying the sandbox (a forget, a TTL delete) waited the whole 5 s stop timeout."""
    import time

    sb = await pdriver.create("slept")
    await sb.start()
    await sb.sleep()
    same = await pdriver.open("slept")
    assert isinstance(same, ProcessSandbox) and not same._alive()
    t0 = time.monotonic()
    await same.destroy()
    assert time.monotonic() - t0 < 2.5, f"destroy took {time.monotonic() - t0:.1f} s"
    assert "slept" not in await pdriver.list()
