"""Micro-VM driver specifics on real QEMU (TCG here): memory kept across sleep, copy-on-write forks that store
only their changed pages, damaged snapshots, host restarts, isolation and hygiene.

One booted template is shared by the module (booting is the slow part under TCG); each test forks from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio
import zstandard

from moorage.config import Config
from moorage.errors import InvalidInput
from moorage.sandbox import SandboxError, SandboxSpec, SandboxState, SnapshotCorrupt, SnapshotIncompatible, TemplateRef
from moorage.sandbox.microvm import MicroVMDriver, MicroVMSandbox
from moorage.sandbox import microvm_ram, microvm_ram_chain as ram_chain
from moorage.sandbox import microvm_net, microvm_user
from moorage.sandbox.microvm_qemu import pid_is_ours

from .test_conformance import _make_wheel

pytestmark = pytest.mark.asyncio(loop_scope="module")

IMAGES_DIR = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
MiB = 1 << 20

#: A process that holds a random token only in its memory and serves it on a unix socket.
TOKEN_SERVER = r"""
import os, socket
token = os.urandom(16).hex()
s = socket.socket(socket.AF_UNIX)
s.bind("/run/token.sock")
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(token.encode())
    c.close()
"""
ASK_TOKEN = ["python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); s.connect('/run/token.sock'); print(s.recv(64).decode())"]
CHECK_WHEEL = ["python3", "-c", "import moorage_canary_pkg as m; print(m.VALUE)"]


def make_driver(root: Path) -> MicroVMDriver:
    for tool in ("qemu-system-x86_64", "qemu-img", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.fail(f"prerequisite missing: {tool} (run scripts/bootstrap.sh)")
    return MicroVMDriver(root, Config(data_dir=root.parent / "data"), images_dir=IMAGES_DIR)


async def out(sb: MicroVMSandbox, argv: list[str], timeout: float = 60) -> str:
    r = await sb.exec(argv, timeout=timeout)
    assert r.ok, (argv, r.exit_code, r.stdout_text, r.stderr_text)
    return r.stdout_text.strip()


async def ask_token(sb: MicroVMSandbox) -> str:
    return await out(sb, ASK_TOKEN)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("microvm") / "sandboxes"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(root: Path) -> AsyncIterator[MicroVMDriver]:
    d = make_driver(root)
    yield d
    cleaner = make_driver(root)
    await d.close()
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()
    cleaner.kill_orphans()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base(driver: MicroVMDriver, tmp_path_factory: pytest.TempPathFactory) -> MicroVMSandbox:
    """A booted guest with a background token server and a wheel installed from the host."""
    sb = await driver.create("base")
    await sb.start()
    await sb.write_file("/work/token_server.py", TOKEN_SERVER.encode())
    await out(sb, ["sh", "-c", "nohup python3 /work/token_server.py >/dev/null 2>&1 & while [ ! -S /run/token.sock ]; do sleep 0.05; done"])
    wheel = _make_wheel(tmp_path_factory.mktemp("wheel"))
    await sb.write_file(f"/work/{wheel.name}", wheel.read_bytes())
    await out(sb, ["python3", "-m", "pip", "install", "--no-index", "--no-cache-dir", f"/work/{wheel.name}"], timeout=180)
    return sb


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def template(driver: MicroVMDriver, base: MicroVMSandbox) -> TemplateRef:
    await base.write_file("/work/from-template.txt", b"template file")
    return await driver.make_template(base, "tpl")


async def test_boot_exec_files_and_no_network_device(base: MicroVMSandbox) -> None:
    assert base.state is SandboxState.RUNNING
    assert await out(base, ["sh", "-c", "echo $((6 * 7))"]) == "42"
    await base.write_file("/work/a/b.txt", b"hello")
    assert await base.read_file("/work/a/b.txt") == b"hello"
    assert [f.name for f in await base.list_files("/work/a")] == ["b.txt"]
    # Its own kernel, and no network interface but loopback.
    assert await out(base, ["ls", "/sys/class/net"]) == "lo"
    assert (await out(base, ["uname", "-r"])).endswith("cloud-amd64")


async def test_sleep_wake_keeps_process_memory_and_installed_wheel(base: MicroVMSandbox) -> None:
    token = await ask_token(base)
    pid = base.pid
    info = await base.sleep()
    assert base.state is SandboxState.SLEEPING and info.includes_memory and info.bytes > 0
    # Sleep returns once the snapshot is durable and QEMU is killed; unmapping its RAM may take a moment more.
    deadline = time.monotonic() + 10
    while pid_is_ours(pid, str(base.run_dir)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pid_is_ours(pid, str(base.run_dir)), "QEMU must be gone while asleep"
    await asyncio.sleep(3)  # the guest clock stands still while asleep; the wake's first call sets it
    await base.wake()
    assert base.last_wake_mode == "snapshot" and base.last_wake_fallback is None
    guest_now = float(await out(base, ["date", "+%s.%N"]))
    assert abs(guest_now - time.time()) < 1.5, guest_now - time.time()
    assert await ask_token(base) == token
    assert await out(base, CHECK_WHEEL) == "from-the-wheel"


async def test_forks_are_independent_and_inherit_memory(driver: MicroVMDriver, base: MicroVMSandbox, template: TemplateRef) -> None:
    token = await ask_token(base)
    kids = await driver.fork(template, ["fork-a", "fork-b"])
    assert [k.state for k in kids] == [SandboxState.SLEEPING] * 2
    # Each fork's disk is a copy of the template's empty child overlay, backed by the template's disk.
    for k in kids:
        assert _backing(k.dir / "disk.qcow2") == str(template.path / "disk.qcow2")
    await asyncio.gather(*(k.wake() for k in kids))
    for k in kids:
        assert k.last_wake_mode == "snapshot"
        assert await ask_token(k) == token  # the template's process, memory and all
        assert await out(k, CHECK_WHEEL) == "from-the-wheel"
        assert await k.read_file("/work/from-template.txt") == b"template file"
    # Independent: writes in one are invisible to the other and to the template's source.
    await kids[0].write_file("/work/from-template.txt", b"changed in a")
    await kids[0].write_file("/work/only-a.txt", b"a")
    assert await kids[1].read_file("/work/from-template.txt") == b"template file"
    assert await kids[1].stat("/work/only-a.txt") is None
    assert await base.stat("/work/only-a.txt") is None
    # Forks do not share a random stream (the host stirs each fork's RNG on its first wake).
    rand = [await out(k, ["python3", "-c", "import os; print(os.urandom(16).hex())"]) for k in kids]
    assert rand[0] != rand[1]
    for k in kids:
        await k.destroy()


async def test_sleeping_fork_stores_only_its_changes(driver: MicroVMDriver, template: TemplateRef) -> None:
    (kid,) = await driver.fork(template, ["fork-delta"])
    await kid.wake()
    await kid.write_file("/work/mine.txt", b"fork data")
    # Touch some memory in a long-lived process so the delta is not trivially empty.
    await out(kid, ["sh", "-c", "nohup python3 -c 'import time; x = bytearray(8 << 20); x[::4096] = b\"z\" * len(x[::4096]); time.sleep(10**6)' >/dev/null 2>&1 &"])
    await asyncio.sleep(1)
    token = await ask_token(kid)
    snap = await kid.sleep()
    stats = await kid.stats()
    # Beyond the template: the RAM delta and device state, plus the disk overlay.
    beyond_template = stats.snapshot_bytes + stats.disk_bytes
    assert 8 * MiB <= beyond_template <= 64 * MiB, beyond_template
    assert snap.bytes == stats.snapshot_bytes
    assert not (kid.dir / "ram").exists(), "a fork keeps no RAM file of its own"
    await kid.wake()
    assert await ask_token(kid) == token
    assert await kid.read_file("/work/mine.txt") == b"fork data"
    # Sleep again after running: the delta is still relative to the template, not growing per cycle.
    await kid.sleep()
    await kid.wake()
    assert await kid.read_file("/work/mine.txt") == b"fork data"
    await kid.destroy()


async def test_a_prepared_sandbox_wakes_by_resuming_its_started_qemu(driver: MicroVMDriver, root: Path, template: TemplateRef) -> None:
    """A sleeping sandbox can be prepared: QEMU up, its snapshot loaded, the guest paused. The wake then only
    resumes it, and what the guest had (memory, files) is there; unprepare stops that QEMU and leaves the snapshot."""
    (kid,) = await driver.fork(template, ["prep-a"])
    assert await kid.prepare() is True and kid.prepared
    pid = kid.pid
    assert kid.state is SandboxState.SLEEPING and pid is not None and Path(f"/proc/{pid}").exists()
    await kid.wake()
    assert kid.pid == pid and kid.last_wake_mode == "snapshot" and "resume" in kid.last_wake_phases
    token = await ask_token(kid)
    await kid.write_file("/work/prep.txt", b"prepared")
    await kid.sleep()
    # Prepared, then unprepared: its QEMU goes, the sandbox is asleep as before and wakes the usual way.
    assert await kid.prepare() is True
    pid = kid.pid
    await kid.unprepare()
    assert not kid.prepared and kid.state is SandboxState.SLEEPING and not _alive(pid)
    await kid.wake()
    assert "resume" not in kid.last_wake_phases and await ask_token(kid) == token
    assert await kid.read_file("/work/prep.txt") == b"prepared"
    await kid.sleep()
    # A host that restarts while a sandbox is prepared kills that QEMU; the sandbox still wakes from its snapshot.
    assert await kid.prepare() is True
    pid = kid.pid
    d2 = make_driver(root)
    k2 = await d2.open("prep-a")
    assert k2.state is SandboxState.SLEEPING and not _alive(pid)
    await k2.wake()
    assert await ask_token(k2) == token
    await k2.destroy()
    await d2.close()


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().split()
    return stat[2] != "Z"


async def test_host_restart_readopts_running_and_sleeping(driver: MicroVMDriver, root: Path, template: TemplateRef) -> None:
    running, sleeping = await driver.fork(template, ["restart-run", "restart-sleep"])
    await asyncio.gather(running.wake(), sleeping.wake())
    await running.write_file("/work/r.txt", b"r")
    await sleeping.write_file("/work/s.txt", b"s")
    token = await ask_token(sleeping)
    pid = running.pid
    await sleeping.sleep()
    # A new driver instance is the host after a restart: same disk, no memory of the old process.
    old_reader = next(t for t in threading.enumerate() if t.name == f"console-{pid}")
    d2 = make_driver(root)
    r2 = await d2.open("restart-run")
    assert r2.state is SandboxState.RUNNING and r2.pid == pid
    assert await r2.read_file("/work/r.txt") == b"r"
    # The re-attached host reads its console again, alone: the earlier instance stopped reading at the hand-over
    # (as a dead host's would), so what the guest prints now can only reach the log through the new reader.
    old_reader.join(2)
    assert not old_reader.is_alive()
    assert sum(t.name == f"console-{pid}" for t in threading.enumerate()) == 1
    assert (await r2.exec(["sh", "-c", "echo re-adopted-console-marker > /dev/console"])).exit_code == 0
    console = r2.dir / "console.log"
    for _ in range(100):
        if b"re-adopted-console-marker" in console.read_bytes():
            break
        await asyncio.sleep(0.05)
    assert b"re-adopted-console-marker" in console.read_bytes()
    s2 = await d2.open("restart-sleep")
    assert s2.state is SandboxState.SLEEPING
    await s2.wake()
    assert await ask_token(s2) == token
    assert await s2.read_file("/work/s.txt") == b"s"
    await r2.destroy()
    await s2.destroy()
    await d2.close()


async def test_a_host_killed_mid_wake_leaves_no_second_qemu_on_the_sandbox(driver: MicroVMDriver, root: Path,
                                                                          template: TemplateRef) -> None:
    """A host killed after it started a wake's QEMU but before it recorded that QEMU as running left it running on
    the sandbox's disk and memory file; the next host then woke the sandbox with a second QEMU on the same files,
    and the guest hung (its first turn got no answer). The next host kills that QEMU before it wakes the sandbox."""
    (kid,) = await driver.fork(template, ["mid-wake"])
    await kid.wake()
    await kid.write_file("/work/m.txt", b"before the crash")
    token = await ask_token(kid)
    await kid.sleep()
    await kid._launch(incoming=True)  # the wake's QEMU is up, waiting for the snapshot; the host dies here
    pid = kid.pid
    assert _alive(pid) and json.loads((kid.dir / "meta.json").read_text())["pid"] is None
    await kid._qmp.close()  # the dead host's connections are gone, and nothing of it is left to tear QEMU down
    kid._proc = kid._qmp = None
    d2 = make_driver(root)
    k2 = await d2.open("mid-wake")
    assert k2.state is SandboxState.SLEEPING and not _alive(pid)
    await k2.wake()
    assert await ask_token(k2) == token
    assert await k2.read_file("/work/m.txt") == b"before the crash"
    # Killed later in the wake: that QEMU had loaded the snapshot and its guest ran, holding the disk (a second
    # QEMU could not even start on it, and the wake failed).
    await k2.sleep()
    before = (k2.dir / "meta.json").read_text()
    await k2.wake()
    (k2.dir / "meta.json").write_text(before)  # its state as the host left it: asleep, no pid recorded
    pid = k2.pid
    await k2._qmp.close()
    await k2._channel.close("the host died")
    k2._proc = k2._qmp = k2._channel = None
    d3 = make_driver(root)
    k3 = await d3.open("mid-wake")
    assert k3.state is SandboxState.SLEEPING and not _alive(pid)
    await k3.wake()
    assert await ask_token(k3) == token
    await k3.destroy()
    await d2.close()
    await d3.close()


async def test_checkpoint_rollback_restores_files_and_memory(driver: MicroVMDriver, template: TemplateRef) -> None:
    (kid,) = await driver.fork(template, ["fork-ckpt"])
    await kid.wake()
    await kid.write_file("/work/state.txt", b"v1")
    token = await ask_token(kid)
    ck = await kid.checkpoint("step1")
    assert ck.includes_memory and ck.bytes > 0
    await kid.write_file("/work/state.txt", b"v2")
    await kid.write_file("/work/later.txt", b"later")
    await out(kid, ["sh", "-c", "pkill -f token_server.py; rm -f /run/token.sock; true"])
    await kid.rollback("step1")
    assert kid.state is SandboxState.RUNNING and kid.last_wake_mode == "snapshot"
    assert await kid.read_file("/work/state.txt") == b"v1"
    assert await kid.stat("/work/later.txt") is None
    assert await ask_token(kid) == token  # the killed process is back, with the same memory
    await kid.destroy()


async def test_processes_restart_in_place_with_a_new_environment_while_the_kernel_and_files_stay(
        driver: MicroVMDriver, template: TemplateRef) -> None:
    """``restart_in_place``: every other process of the guest is killed and a fresh supervisor forked from the
    guest's holder (a redeploy whose packages changed), or the holder executes itself afresh when what an
    interpreter reads as it starts changed; its environment survives the supervisor's own restart by init and the
    VM's next cold boot."""
    (sb,) = await driver.fork(template, ["fork-inplace"])
    await sb.wake()
    kernel = await out(sb, ["cat", "/proc/sys/kernel/random/boot_id"])
    await ask_token(sb)  # the template's background process runs in the fork
    before = await sb.ping()
    env = "echo ${MOORAGE_T_A:-_}${MOORAGE_T_B:-_}"

    t = time.monotonic()
    assert await driver.restart_in_place(sb, {"MOORAGE_T_A": "1", "MOORAGE_T_B": "2"}) is True
    took = time.monotonic() - t
    after = await sb.ping()
    assert after["boot_id"] != before["boot_id"] and after["pid"] != before["pid"]
    assert after["interpreter"] == before["interpreter"], "forked from the holder, not a new interpreter"
    assert await out(sb, ["cat", "/proc/sys/kernel/random/boot_id"]) == kernel, "the kernel must not reboot"
    assert not (await sb.exec(ASK_TOKEN)).ok, "every other process ends"
    assert await out(sb, ["sh", "-c", env]) == "12"
    assert await sb.read_file("/work/from-template.txt") == b"template file"
    assert driver.boot_env(sb) == {"MOORAGE_T_A": "1", "MOORAGE_T_B": "2"}
    assert took < 8, f"restart in place took {took:.1f} s"

    # A key the new environment drops is gone; one an interpreter reads as it starts (TZ) takes a new interpreter;
    # no environment given keeps the one it has.
    assert await driver.restart_in_place(sb, {"MOORAGE_T_B": "3", "TZ": "UTC"}) is True
    assert await out(sb, ["sh", "-c", env]) == "_3"
    assert (await sb.ping())["interpreter"] != after["interpreter"]
    assert await driver.restart_in_place(sb) is True
    assert await out(sb, ["sh", "-c", env]) == "_3"

    # The supervisor dies on its own: the guest's init starts it again with the environment it was restarted with.
    pid = (await sb.ping())["pid"]
    await out(sb, ["sh", "-c", f"(sleep 0.5; kill -9 {pid}) >/dev/null 2>&1 &"])
    deadline = time.monotonic() + 60
    while True:
        try:
            if (await sb.ping(timeout=2))["pid"] != pid:
                break
        except SandboxError:
            pass
        assert time.monotonic() < deadline, "the guest's init did not start the supervisor again"
        await asyncio.sleep(0.2)
    assert await out(sb, ["sh", "-c", env]) == "_3"

    # A NIC comes only with a boot (where this host can make one): then nothing changes, the caller boots it.
    nic = microvm_net.available()
    assert await driver.restart_in_place(sb, {"MOORAGE_T_B": "3", microvm_net.WANT_ENV: "1"}) is (not nic)
    if nic:
        assert driver.boot_env(sb) == {"MOORAGE_T_B": "3", "TZ": "UTC"} and (await sb.ping())["pid"] != pid
    # The next cold boot has the environment too (its kernel command line).
    await sb.stop()
    await sb.start()
    assert await out(sb, ["sh", "-c", env]) == "_3"
    await sb.destroy()


#: A process that keeps 4 MiB of memory filled with a value it is sent, and answers with the value (a "!" after it
#: when the buffer no longer holds it everywhere).
MEMORY_HOLDER = r"""
import socket
buf = bytearray(4 << 20)
val = b""
def fill(v):
    global val
    val = v
    page = (v * (4096 // len(v) + 1))[:4096]
    for i in range(0, len(buf), 4096):
        buf[i : i + 4096] = page
fill(b"v0")
s = socket.socket(socket.AF_UNIX)
s.bind("/run/mem.sock")
s.listen()
while True:
    c, _ = s.accept()
    cmd = c.recv(64)
    if cmd.startswith(b"put "):
        fill(cmd[4:])
    whole = all(buf[i : i + len(val)] == val for i in range(0, len(buf), 4096))
    c.sendall(val + (b"" if whole else b"!"))
    c.close()
"""


async def held(sb: MicroVMSandbox, put: str | None = None) -> str:
    cmd = f"put {put}" if put else "get"
    return await out(sb, ["python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                          f"s.connect('/run/mem.sock'); s.sendall(b'{cmd}'); print(s.recv(64).decode())"])


async def test_checkpoints_store_the_pages_changed_since_the_last_and_roll_back_through_the_chain(
        driver: MicroVMDriver, template: TemplateRef) -> None:
    (kid,) = await driver.fork(template, ["fork-chain"])
    await kid.wake()
    await kid.write_file("/work/holder.py", MEMORY_HOLDER.encode())
    await out(kid, ["sh", "-c", "nohup python3 /work/holder.py >/dev/null 2>&1 & "
                    "while [ ! -S /run/mem.sock ]; do sleep 0.05; done"])
    cps = kid.dir / "checkpoints"

    def record(name: str) -> dict:
        return json.loads((cps / name / "snapshot.json").read_text())

    # c1..c10; the held value changes before c3, c5, c6 and c10 (4 MiB of changed pages each time).
    values = {}
    for i in range(1, 11):
        if i in (3, 5, 6, 10):
            assert await held(kid, f"v{i}") == f"v{i}"
        await kid.write_file("/work/state.txt", f"s{i}".encode())
        await kid.checkpoint(f"c{i}")
        values[i] = await held(kid)
    chains = {i: ram_chain.info(cps / f"c{i}") for i in range(1, 11)}
    # Whole at the first and after MAX_DEPTH, each of the others on the one before.
    assert [chains[i]["depth"] for i in range(1, 11)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert all(chains[i]["base"] == f"c{i - 1}" for i in (2, 3, 4, 5, 6, 7, 8, 10))
    assert record("c1")["delta_bytes"] == record("c1")["ram_bytes"] >= 4 * MiB
    # A checkpoint stores what changed: with the 4 MiB unchanged, well under the whole; with it changed, over 4 MiB.
    for i in (2, 4, 7, 8):
        assert record(f"c{i}")["delta_bytes"] < record(f"c{i}")["ram_bytes"] - 3 * MiB, (i, record(f"c{i}"))
    for i in (3, 5, 6, 10):
        assert record(f"c{i}")["delta_bytes"] >= 4 * MiB, (i, record(f"c{i}"))
    assert record("c9")["delta_bytes"] == record("c9")["ram_bytes"]

    # Roll back into the middle of a chain: memory and files as they were at c4 (built on c3, c2, c1).
    await kid.rollback("c4")
    assert await held(kid) == values[4] == "v3"
    assert await kid.read_file("/work/state.txt") == b"s4"
    # A checkpoint after a rollback builds on the checkpoint rolled back to.
    await kid.checkpoint("after")
    assert ram_chain.info(cps / "after")["base"] == "c4"

    # Retention deletes bases still built on: they stop listing and keep their pages until nothing needs them.
    for i in (1, 2, 3):
        await kid.delete_checkpoint(f"c{i}")
    assert {c.name for c in await kid.checkpoints()} == {f"c{i}" for i in range(4, 11)} | {"after"}
    assert all((cps / f"c{i}").is_dir() and not (cps / f"c{i}" / "snapshot.json").exists() for i in (1, 2, 3))
    await kid.rollback("c6")
    assert await held(kid) == "v6" and await kid.read_file("/work/state.txt") == b"s6"
    for i in (4, 5, 6, 7, 8):
        await kid.delete_checkpoint(f"c{i}")
    assert (cps / "c4").is_dir()  # "after" builds on it
    await kid.delete_checkpoint("after")
    assert sorted(p.name for p in cps.iterdir()) == ["c10", "c9"]

    # Stored compressed: the echo of a held buffer's pages shrinks on disk.
    assert all(record(f"c{i}")["stored_bytes"] < record(f"c{i}")["delta_bytes"] / 2 for i in (9, 10))
    # A base stored raw (checkpoints from before compression) still rolls back, under a compressed top.
    c9 = cps / "c9"
    (c9 / "ram.delta").write_bytes(zstandard.ZstdDecompressor().decompress((c9 / "ram.zst").read_bytes()))
    (c9 / "ram.zst").unlink()
    await kid.rollback("c10")
    assert await held(kid) == values[10] and await kid.read_file("/work/state.txt") == b"s10"

    # A base's page changed on the host: the rollback is refused before anything stops, the guest runs on.
    assert await held(kid, "v11") == "v11"
    def pages(name: str, f: str) -> list[int]:
        return [p for a, n in microvm_ram.read_runs(cps / name / f) for p in range(a, a + n)]

    # One that c10 takes from c9 (in c10's whole set, not stored by c10 itself).
    c9_own, c10_own = pages("c9", "ram.own"), set(pages("c10", "ram.own"))
    k = next(i for i, p in enumerate(c9_own) if p not in c10_own and p in set(pages("c10", "ram.idx")))
    with open(cps / "c9" / "ram.delta", "r+b") as f:
        f.seek(4096 * k)
        byte = f.read(1)
        f.seek(4096 * k)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SnapshotCorrupt, match="changed"):
        await kid.rollback("c10")
    assert kid.state is SandboxState.RUNNING and await held(kid) == "v11"
    # A compressed frame that claims another size is refused before it is decompressed.
    (cps / "c10" / "ram.zst").write_bytes(zstandard.ZstdCompressor().compress(bytes(4096)))
    with pytest.raises(SnapshotCorrupt, match="do not match its index"):
        await kid.rollback("c10")
    assert kid.state is SandboxState.RUNNING and await held(kid) == "v11"
    await kid.destroy()


async def _disk_snapshot_tags(sb: MicroVMSandbox) -> set[str]:
    """The internal snapshots of the running sandbox's disk, as its QEMU reports them."""
    disk = next(b for b in await sb._qmp.execute("query-block") if b["device"] == "disk")
    return {s["name"] for s in disk["inserted"]["image"].get("snapshots", [])}


async def test_a_checkpoint_written_behind_lets_the_guest_run_on_and_every_other_verb_waits_for_its_files(
        driver: MicroVMDriver, template: TemplateRef, monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint(durable=False)`` (the automatic one after a turn) returns once the guest runs again; its pages
    are compressed and its files written behind. The next verb (a listing, a checkpoint, a rollback) waits for
    them; a write that fails leaves no checkpoint of that name and the guest running."""
    (kid,) = await driver.fork(template, ["fork-behind"])
    await kid.wake()
    await kid.write_file("/work/holder.py", MEMORY_HOLDER.encode())
    await out(kid, ["sh", "-c", "nohup python3 /work/holder.py >/dev/null 2>&1 & "
                    "while [ ! -S /run/mem.sock ]; do sleep 0.05; done"])
    cps = kid.dir / "checkpoints"
    assert await held(kid, "b1") == "b1"
    await kid.checkpoint("b1", durable=False)
    # Returned with the guest running and nothing of the checkpoint in place yet.
    assert kid._lock.behind is not None and not kid._lock.behind.done()
    assert not (cps / "b1").exists() and (cps / "b1.new").is_dir()
    assert await held(kid, "b2") == "b2"  # the guest's work goes on meanwhile
    assert [c.name for c in await kid.checkpoints()] == ["b1"]  # a listing waits for the files
    await kid.checkpoint("b2", durable=False)
    await kid.checkpoint("b3")  # waits for b2's files, and builds on them
    assert ram_chain.info(cps / "b3")["base"] == "b2" and ram_chain.info(cps / "b2")["base"] == "b1"
    await kid.rollback("b1")
    assert await held(kid) == "b1"

    # A write that fails (the disk full, here made to fail): no checkpoint b4, no leftovers, the guest runs on.
    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ram_chain, "write", full)
    await kid.checkpoint("b4", durable=False)
    assert "b4" not in {c.name for c in await kid.checkpoints()}
    assert not (cps / "b4").exists() and not (cps / "b4.new").exists()
    tags = await _disk_snapshot_tags(kid)
    assert "ckpt-b4" not in tags and "ckpt-b3" in tags  # nor its disk snapshot
    assert kid.state is SandboxState.RUNNING and await held(kid, "b5") == "b5"
    monkeypatch.undo()
    await kid.checkpoint("b5")  # its base (b4) was never written: a whole one
    assert ram_chain.info(cps / "b5")["depth"] == 0
    await kid.rollback("b5")
    assert await held(kid) == "b5"
    await kid.destroy()


async def test_the_pause_copies_the_guests_pages_and_the_comparison_after_it_finds_the_same(
        driver: MicroVMDriver, template: TemplateRef) -> None:
    """A checkpoint's pause copies the guest's private pages (``copy_dirty``) and leaves their comparison with the
    template for after it: the same pages as compared in the pause; too many to copy are compared in the pause."""
    (kid,) = await driver.fork(template, ["fork-copy"])
    await kid.wake()
    await out(kid, ["sh", "-c", "head -c 3000000 /dev/urandom > /dev/shm/r; echo same > /dev/shm/s"])
    assert kid._qmp is not None and kid.pid is not None
    await kid._qmp.execute("stop")
    try:
        m = microvm_ram.find_mapping(kid.pid, kid._ram_path())
        dirty = microvm_ram.copy_dirty(kid.pid, m)
        assert dirty is not None and len(dirty.data) == sum(n for _, n in dirty.runs) * microvm_ram.PAGE
        in_pause = list(microvm_ram.changed_pages(kid.pid, m, kid._ram_path()))
        assert microvm_ram.copy_dirty(kid.pid, m, limit=len(dirty.data) - 1) is None
    finally:
        await kid._qmp.execute("cont")
    await out(kid, ["sh", "-c", "head -c 1000000 /dev/urandom > /dev/shm/later"])  # the guest runs on
    after = list(microvm_ram.changed_pages(kid.pid, m, kid._ram_path(), dirty))
    assert len(in_pause) > 700 and after == in_pause
    await kid.checkpoint("c1", durable=False)
    await kid.checkpoint("c2")  # waits for c1's files, compared after its pause
    assert "ram_compare" in kid.last_snapshot_phases and "ram_capture" in kid.last_snapshot_phases
    await kid.rollback("c1")
    assert await out(kid, ["cat", "/dev/shm/s"]) == "same"
    await kid.destroy()


#: Holds 96 MiB of random (incompressible) bytes in memory, then says so in /run (a tmpfs: guest RAM too).
HOLD_RANDOM = r"""
import os, time
held = os.urandom(96 << 20)
open("/run/held", "w").write("held")
time.sleep(1e9)
"""


async def test_a_guest_full_of_random_memory_checkpoints_and_rolls_back_with_the_host_flat(
        driver: MicroVMDriver, template: TemplateRef) -> None:
    """The pages a checkpoint stores are streamed through files, both when taken (read in the pause, compressed
    after) and when a rollback decompresses them: a guest that fills its RAM with what does not compress costs the
    host disk, never memory."""
    from tests.attacks.conftest import RssWatch

    (kid,) = await driver.fork(template, ["fork-random-ram"])
    await kid.wake()
    await kid.write_file("/work/hold.py", HOLD_RANDOM.encode())
    await out(kid, ["sh", "-c", "nohup python3 /work/hold.py >/dev/null 2>&1 & "
                    "while [ ! -e /run/held ]; do sleep 0.05; done"], timeout=180)
    with RssWatch() as rss:
        await kid.checkpoint("full")
    rec = json.loads((kid.dir / "checkpoints" / "full" / "snapshot.json").read_text())
    assert rec["stored_bytes"] >= 90 * MiB, rec  # it did not compress: the pages went through the host
    assert rss.growth < 32 * MiB, rss.growth
    await out(kid, ["rm", "/run/held"])
    with RssWatch() as rss:
        await kid.rollback("full")
    assert rss.growth < 32 * MiB, rss.growth
    assert await out(kid, ["cat", "/run/held"]) == "held"
    await kid.destroy()


async def _clock_skew_and_rtt(sb: MicroVMSandbox) -> tuple[float, float]:
    """Guest minus host wall clock, from the tightest of three reads, and that read's latency (the error)."""
    best: tuple[float, float] | None = None
    for _ in range(3):
        t0 = time.time()
        guest = float(await out(sb, ["date", "+%s.%N"]))
        t1 = time.time()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, guest - (t0 + t1) / 2)
    assert best is not None
    return best[1], best[0]


async def _clock_skew(sb: MicroVMSandbox) -> float:
    return (await _clock_skew_and_rtt(sb))[0]


async def test_checkpoints_and_wakes_leave_the_guest_clock_where_the_host_is(driver: MicroVMDriver,
                                                                               template: TemplateRef) -> None:
    """A checkpoint pauses the guest, and its clock stands still meanwhile (~25 ms each here): the host sets it
    again once the guest runs on (a checkpoint written behind too), as after a wake."""
    (kid,) = await driver.fork(template, ["fork-clock"])
    await kid.wake()
    for i in range(12):
        await kid.checkpoint(f"c{i % 3}", durable=bool(i % 2))
    await kid.checkpoints()  # the last one's files, and its clock call
    # 12 pauses left uncorrected: ~0.3 s behind, more on a loaded host (the wake's own setting is sent before the
    # cold guest reads it, so it starts some tens of ms behind; the one after a pause reaches a warm guest).
    skew = await _clock_skew(kid)
    assert abs(skew) < 0.1, skew
    # A wake: its first reply's setting reaches a cold guest late; it is set again once the guest is warm.
    await kid.sleep()
    await asyncio.sleep(1.0)
    await kid.wake()
    assert kid._clock_again is not None
    await kid._clock_again  # (nothing else runs in the guest meanwhile: a busy guest would read it late too)
    skew, rtt = await _clock_skew_and_rtt(kid)
    assert abs(skew) < 0.02 + rtt / 2, (skew, rtt)  # uncorrected: 40-110 ms behind here
    await kid.destroy()


def _qcow2_dirty(path: Path) -> bool:
    """The qcow2 header's dirty bit (incompatible features, bit 0): refcounts behind, repaired on the next open."""
    with open(path, "rb") as f:
        f.seek(72)
        return bool(int.from_bytes(f.read(8), "big") & 1)


def _qemu_img_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", "check", str(path)], capture_output=True, text=True)


async def test_the_disk_is_closed_clean_at_sleep_and_repaired_after_a_kill(driver: MicroVMDriver, template: TemplateRef) -> None:
    """The disk runs with lazy refcounts (the writes after a checkpoint's disk snapshot do not wait for refcount
    updates): a sleep quits QEMU so the image is left clean; a QEMU that is killed leaves it marked dirty, and the
    next open repairs it with every file intact."""
    (kid,) = await driver.fork(template, ["fork-clean-disk"])
    await kid.wake()
    disk = kid.dir / "disk.qcow2"
    await kid.checkpoint("c1")
    await kid.write_file("/work/after.bin", b"a" * 300_000)
    await out(kid, ["sync"])
    await kid.sleep()
    assert not _qcow2_dirty(disk)
    r = _qemu_img_check(disk)
    assert r.returncode == 0 and "No errors" in r.stdout, r.stdout + r.stderr

    # Killed while running (as a host crash would): the image stays marked dirty.
    await kid.wake()
    await kid.write_file("/work/after2.bin", b"b" * 300_000)
    await out(kid, ["sync"])
    await kid.stop()
    assert _qcow2_dirty(disk)
    await kid.start()  # a cold boot: QEMU repairs the image as it opens it
    assert await kid.read_file("/work/after.bin") == b"a" * 300_000
    assert await kid.read_file("/work/after2.bin") == b"b" * 300_000
    await kid.sleep()
    assert not _qcow2_dirty(disk) and _qemu_img_check(disk).returncode == 0
    # The checkpoint taken before it all still rolls back (qemu-img reverts the repaired image).
    await kid.wake()
    await kid.rollback("c1")
    names = {f.name for f in await kid.list_files("/work")}
    assert "from-template.txt" in names and not names & {"after.bin", "after2.bin"}, names
    await kid.destroy()


class _SlowToExit:
    """A QEMU process handle that reads as running for a while after the process died: QEMU closes its sockets as
    it exits, a moment before it can be reaped, and on a loaded host that moment outlasted the host's 0.1 s check (a
    CI run: every turn after it answered 409 "its channel is not connected")."""

    def __init__(self, proc: subprocess.Popen[bytes], delay_s: float) -> None:
        self._proc, self._until = proc, time.monotonic() + delay_s

    def poll(self) -> int | None:
        return None if time.monotonic() < self._until else self._proc.poll()

    def __getattr__(self, name: str) -> object:
        return getattr(self._proc, name)


async def test_a_qemu_that_dies_slowly_is_marked_stopped_when_its_channel_closes(driver: MicroVMDriver, root: Path,
                                                                                 template: TemplateRef) -> None:
    (kid,) = await driver.fork(template, ["fork-slow-exit"])
    await kid.wake()
    await kid.write_file("/work/kept.txt", b"kept")
    await out(kid, ["sync"])
    assert kid._proc is not None
    kid._proc = _SlowToExit(kid._proc, delay_s=2.0)  # type: ignore[assignment]
    os.kill(kid.pid, 9)
    deadline = time.monotonic() + 1.5  # before its process reads as gone
    while kid.state is SandboxState.RUNNING and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert kid.state is SandboxState.STOPPED
    await kid.wake()  # from its disk
    assert kid.last_wake_mode == "cold"
    assert await kid.read_file("/work/kept.txt") == b"kept"

    # Re-adopted by a restarted host, which has no handle on the process (before, its death went unnoticed).
    d2 = make_driver(root)
    again = await d2.open("fork-slow-exit")
    assert again.state is SandboxState.RUNNING and again._proc is None
    assert await again.read_file("/work/kept.txt") == b"kept"
    os.kill(again.pid, 9)
    deadline = time.monotonic() + 10
    while again.state is SandboxState.RUNNING and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert again.state is SandboxState.STOPPED
    await again.wake()
    assert await again.read_file("/work/kept.txt") == b"kept"
    await again.destroy()
    await d2.close()


async def test_damaged_snapshots_fall_back_to_a_cold_boot_with_files_intact(driver: MicroVMDriver, template: TemplateRef) -> None:
    (kid,) = await driver.fork(template, ["fork-damaged"])
    await kid.wake()
    await kid.write_file("/work/keep.txt", b"kept on disk")
    await kid.sleep()
    # Truncated RAM delta: corrupt.
    delta = kid.dir / "snapshot" / "ram.delta"
    with open(delta, "r+b") as f:
        f.truncate(delta.stat().st_size // 2)
    await kid.wake()
    assert isinstance(kid.last_wake_fallback, SnapshotCorrupt) and "checksum" in str(kid.last_wake_fallback)
    assert kid.last_wake_mode == "cold" and kid.state is SandboxState.RUNNING
    assert await kid.read_file("/work/keep.txt") == b"kept on disk"
    # Taken by another QEMU build: incompatible.
    await kid.write_file("/work/keep2.txt", b"also kept")
    await kid.sleep()
    meta = json.loads((kid.dir / "meta.json").read_text())
    meta["snapshot"]["qemu"] = "QEMU emulator version 0.0.1"
    (kid.dir / "meta.json").write_text(json.dumps(meta))
    d2 = make_driver(driver.root)
    k2 = await d2.open("fork-damaged")
    await k2.wake()
    assert isinstance(k2.last_wake_fallback, SnapshotIncompatible) and "0.0.1" in str(k2.last_wake_fallback)
    assert await k2.read_file("/work/keep2.txt") == b"also kept"
    # Corrupt device state after a cold boot (shared RAM mode now).
    await k2.sleep()
    (k2.dir / "snapshot" / "dev.state").write_bytes(b"\0" * 100)
    await k2.wake()
    assert isinstance(k2.last_wake_fallback, SnapshotCorrupt)
    assert await k2.read_file("/work/keep.txt") == b"kept on disk"
    await k2.destroy()
    await d2.close()


async def test_guest_is_isolated_and_abuse_is_contained(driver: MicroVMDriver, template: TemplateRef, tmp_path_factory: pytest.TempPathFactory) -> None:
    canary = tmp_path_factory.mktemp("canary") / "host-canary.txt"
    canary.write_text("host secret")
    hits: list[bool] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(True)
        w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    abuser, bystander = await driver.fork(template, ["abuser", "bystander"])
    await asyncio.gather(abuser.wake(), bystander.wake())
    await bystander.write_file("/work/secret.txt", b"bystander secret")
    try:
        probe = f"""
import glob, os, socket
found = []
for p in [{str(canary)!r}, {str(bystander.dir)!r} + "/disk.qcow2"]:
    if os.path.exists(p): found.append("PATH " + p)
for host in ["127.0.0.1", "10.0.2.2", "192.168.122.1"]:
    try:
        socket.create_connection((host, {port}), timeout=2).close(); found.append("TCP " + host)
    except OSError:
        pass
disks = sorted(os.path.basename(d) for d in glob.glob("/sys/block/*") if not os.path.basename(d).startswith(("loop", "ram")))
if disks != ["vda"]: found.append("DISKS " + ",".join(disks))
print("|".join(found) or "ISOLATED")
"""
        await abuser.write_file("/work/probe.py", probe.encode())
        assert await out(abuser, ["python3", "/work/probe.py"]) == "ISOLATED"
        assert hits == []
        # Memory hog: the VM's RAM is the bound; the guest kernel kills the hog, the host does not notice.
        hog = await abuser.exec(["python3", "-c", "x = [bytearray(1 << 20) for _ in range(2048)]; print('ALL')"], timeout=120)
        assert not hog.ok and b"ALL" not in hog.stdout
        # Fork bomb: the pids cgroup stops it.
        bomb = await abuser.exec(["python3", "-c", "import os\nn = 0\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n            import time; time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError:\n    print('LIMITED', n)\n"], timeout=120)
        assert bomb.stdout_text.startswith("LIMITED"), bomb.stdout_text
        await asyncio.sleep(4)  # the bomb's children exit after 3 s and free their pids
        # Disk filler, in files under the per-file cap: the overlay's virtual size is the bound.
        script = "for i in $(seq 30); do yes moorage | dd of=/work/fill$i bs=1M count=100 iflag=fullblock conv=fsync 2>&1 || exit 1; done"
        fill = await abuser.exec(["sh", "-c", script], timeout=400)
        assert not fill.ok and b"No space left" in fill.stdout, fill
        assert (await abuser.stats()).disk_bytes < 1200 * MiB
        # Everyone else is fine, and the abuser's own supervisor still answers.
        assert await bystander.read_file("/work/secret.txt") == b"bystander secret"
        assert await out(bystander, ["echo", "alive"]) == "alive"
        assert (await abuser.ping())["pong"]
    finally:
        server.close()
        await server.wait_closed()
        await abuser.destroy()
        await bystander.destroy()


async def test_destroy_kills_qemu_and_orphans_are_found(driver: MicroVMDriver, root: Path, template: TemplateRef) -> None:
    gone, orphan = await driver.fork(template, ["to-destroy", "to-orphan"])
    await asyncio.gather(gone.wake(), orphan.wake())
    pid = gone.pid
    key = str(gone.dir.resolve())

    def claims() -> set[str]:
        return {os.readlink(e) for e in microvm_user.REGISTRY.iterdir() if e.is_symlink()}

    assert key in claims()  # its QEMU ran as a uid of its own
    await gone.destroy()
    assert gone.state is SandboxState.DESTROYED and not gone.dir.exists()
    assert key not in claims()  # given back: the registry holds directories that exist
    assert not pid_is_ours(pid, str(gone.run_dir))
    assert "to-destroy" not in await driver.list()
    # A host crash in the middle of a sleep: the metadata says sleeping, the QEMU still runs.
    opid = orphan.pid
    meta = json.loads((orphan.dir / "meta.json").read_text())
    meta["state"] = "sleeping"
    (orphan.dir / "meta.json").write_text(json.dumps(meta))
    d2 = make_driver(root)
    assert opid in d2.find_orphans()
    assert opid in d2.kill_orphans()
    assert not pid_is_ours(opid, str(orphan.run_dir))
    await orphan.destroy()
    await d2.close()


async def test_template_outlives_delete_while_forks_use_it(driver: MicroVMDriver, base: MicroVMSandbox) -> None:
    tpl = await driver.make_template(base, "tpl-short")
    # A template made before templates kept a child overlay: its forks create their own disk overlay.
    (tpl.path / "child.qcow2").unlink()
    (kid,) = await driver.fork(tpl, ["fork-late"])
    assert _backing(kid.dir / "disk.qcow2") == str(tpl.path / "disk.qcow2")
    await driver.delete_template(tpl)
    assert tpl.path.exists(), "a fork still maps its RAM and disk"
    with pytest.raises(Exception, match="deleted"):
        await driver.fork(tpl, ["never"])
    await kid.wake()
    assert await kid.read_file("/work/from-template.txt") == b"template file"
    await kid.destroy()
    assert not tpl.path.exists()


def _qemu_img_info(path: Path) -> dict:
    return json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], check=True,
                                     capture_output=True, text=True).stdout)


def _backing(path: Path) -> str:
    return _qemu_img_info(path)["backing-filename"]


async def test_disk_size_follows_the_spec(driver: MicroVMDriver) -> None:
    """disk_mib is the agent's own space: the disk is the (shrunk) image root plus disk_mib, grown into at boot."""
    image_mib = (await asyncio.to_thread(driver.image)).disk_mib
    with pytest.raises(InvalidInput, match="disk_mib"):
        await driver.create("no-disk", SandboxSpec(disk_mib=0))
    assert not (driver.root / "no-disk").exists()
    sb = await driver.create("sized-disk", SandboxSpec(disk_mib=200))
    try:
        assert _qemu_img_info(sb.dir / "disk.qcow2")["virtual-size"] == (image_mib + 200) * MiB
        await sb.start()
        # Free space: the 200 MiB plus the image's slack (32 MiB and resize2fs's margin), less ext4 metadata.
        avail_mib = int((await out(sb, ["sh", "-c", "df -m / | tail -1"])).split()[3])
        assert 180 <= avail_mib <= 200 + 64, avail_mib
        # Filling it stops at the limit; the host file stays bounded by it.
        await out(sb, ["sh", "-c", "dd if=/dev/zero of=/work/fill bs=1M count=400 2>/dev/null; sync; true"], timeout=120)
        written = (await sb.stat("/work/fill")).size
        assert written <= (200 + 64) * MiB, written
        assert (sb.dir / "disk.qcow2").stat().st_size <= (200 + 96) * MiB
    finally:
        await sb.destroy()


def _ids(pid: int) -> dict[str, list[int]]:
    st = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return {"uid": [int(x) for x in st["Uid"].split()], "gid": [int(x) for x in st["Gid"].split()],
            "groups": [int(x) for x in st["Groups"].split()], "cap_eff": [int(st["CapEff"], 16)]}


#: Run as a QEMU's own uid, gid and groups: open each target, report "opened" or the error.
_PROBE = """
import json, os, sys
out = {}
for label, target, flag in json.loads(sys.argv[1]):
    try:
        os.close(os.open(target, getattr(os, flag)))
        out[label] = "opened"
    except OSError as e:
        out[label] = e.strerror
print(json.dumps(out))
"""


def _open_as(pid: int, targets: dict[str, tuple[Path | str, str]]) -> dict[str, str]:
    """Try to open each file as the QEMU ``pid`` runs (a setpriv probe). A file is handed to the probe as an O_PATH
    descriptor (``/proc/self/fd/N``), so no 0700 directory above it stands in the way: its owner and mode alone
    decide. A target given as ``str`` is opened by name."""
    ids = _ids(pid)
    fds, spec = [], []
    try:
        for label, (path, flag) in targets.items():
            if isinstance(path, str):
                spec.append((label, str(path), flag))
                continue
            fd = os.open(path, os.O_PATH)
            fds.append(fd)
            spec.append((label, f"/proc/self/fd/{fd}", flag))
        groups = f"--groups={','.join(map(str, ids['groups']))}" if ids["groups"] else "--clear-groups"
        r = subprocess.run(["setpriv", f"--reuid={ids['uid'][0]}", f"--regid={ids['gid'][0]}", groups, "--",
                            "/usr/bin/python3", "-c", _PROBE, json.dumps(spec)],
                           capture_output=True, text=True, pass_fds=fds, timeout=30)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    finally:
        for fd in fds:
            os.close(fd)


async def test_qemu_runs_as_a_uid_of_its_own_that_opens_no_other_vms_files(driver: MicroVMDriver, base: MicroVMSandbox, template: TemplateRef) -> None:
    """On a root host each QEMU runs as its sandbox's own unprivileged uid (booted, woken, forked, rolled back), and
    that uid can open its own disk and its template's disk but not its template's RAM file, nor any other sandbox's
    RAM, disk or memory."""
    from moorage.sandbox.microvm_user import VM_ID_BASE, VM_ID_SLOTS

    await base.wake()
    a, b = await driver.fork(template, ["uid-a", "uid-b"])
    await asyncio.gather(a.wake(), b.wake())
    if os.geteuid() != 0:  # an unprivileged host: QEMU simply runs as the host's own uid
        assert _ids(a.pid)["uid"][0] == os.geteuid()
        return
    seen = {}
    for sb in (base, a, b):
        ids = _ids(sb.pid)
        uid = ids["uid"][0]
        assert ids["uid"] == [uid] * 4 and ids["gid"] == [uid] * 4, ids  # real, effective, saved and fs ids
        assert VM_ID_BASE <= uid < VM_ID_BASE + VM_ID_SLOTS and ids["cap_eff"] == [0], ids
        seen[sb.id] = uid
    assert len(set(seen.values())) == 3, seen  # one uid per sandbox
    tpl_gid = (template.path / "disk.qcow2").stat().st_gid
    assert _ids(a.pid)["groups"] == [tpl_gid] and _ids(base.pid)["groups"] == [], "only a fork gets its template's group"
    # After a sleep and a wake, and after a rollback: the same uid again, never 0.
    await a.sleep()
    await a.wake()
    assert _ids(a.pid)["uid"] == [seen["uid-a"]] * 4
    await a.checkpoint("c1")
    sets = await a._qmp.execute("query-fdsets")  # device state went by descriptor, and none stays behind
    assert not [s for s in sets for f in s["fds"] if f.get("opaque", "").endswith("dev.state")], sets
    await a.rollback("c1")
    assert a.last_wake_mode == "snapshot" and _ids(a.pid)["uid"] == [seen["uid-a"]] * 4
    # What a's uid may open: its own disk and its template's disk (read only). Not its template's RAM file (it maps
    # a sealed copy, see below), nothing of b (a fork of the same template), of base, or of b's process.
    got = _open_as(a.pid, {
        "own disk": (a.dir / "disk.qcow2", "O_RDWR"),
        "template ram": (template.path / "ram", "O_RDWR"),
        "template ram, read": (template.path / "ram", "O_RDONLY"),
        "template disk, read": (template.path / "disk.qcow2", "O_RDONLY"),
        "template disk, write": (template.path / "disk.qcow2", "O_WRONLY"),
        "sibling disk": (b.dir / "disk.qcow2", "O_RDONLY"),
        "base ram": (base.dir / "ram", "O_RDONLY"),
        "base disk": (base.dir / "disk.qcow2", "O_RDONLY"),
        "base ram by name": (str(base.dir / "ram"), "O_RDONLY"),
        "sibling memory": (f"/proc/{b.pid}/mem", "O_RDONLY"),
        "own checkpoint state": (a.dir / "checkpoints" / "c1" / "dev.state", "O_RDONLY"),
    })
    denied = "Permission denied"
    assert got == {
        "own disk": "opened", "template ram": denied, "template ram, read": denied, "template disk, read": "opened",
        "template disk, write": denied, "sibling disk": denied, "base ram": denied, "base disk": denied,
        "base ram by name": denied, "sibling memory": denied, "own checkpoint state": denied,
    }, got
    await a.destroy()
    await b.destroy()


#: Run as a fork's QEMU uid with the descriptor of its template's RAM that QEMU holds (inherited as fd N): every
#: way to change its bytes, each reported as "changed" or the error.
_RAM_PROBE = """
import ctypes, errno, fcntl, json, mmap, os, sys
fd_no = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
out = {}
def attempt(label, f):
    try:
        f()
        out[label] = "changed"
    except OSError as e:
        out[label] = errno.errorcode.get(e.errno, str(e.errno))
def punch(fd):
    if libc.fallocate(fd, 3, 0, 4096):  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        raise OSError(ctypes.get_errno(), "fallocate")
size = os.fstat(fd_no).st_size
first = os.pread(fd_no, 4096, 0)
fd = os.open(f"/proc/self/fd/{fd_no}", os.O_RDWR)  # as QEMU 7.2 opens mem-path: this works
attempt("write", lambda: os.write(fd, b"owned"))
attempt("pwrite", lambda: os.pwrite(fd, b"owned", 4096))
attempt("punch hole", lambda: punch(fd))
attempt("truncate shorter", lambda: os.ftruncate(fd, 4096))
attempt("truncate longer", lambda: os.ftruncate(fd, size + 4096))
attempt("map shared writable", lambda: mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
attempt("remove seals", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0))
private = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
private[:5] = b"owned"  # copy-on-write: this process's page only
out["private copy written"] = private[:5] == b"owned"
out["seals"] = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
out["unchanged"] = os.pread(fd, 4096, 0) == first and os.fstat(fd).st_size == size
print(json.dumps(out))
"""


def _same_bytes(fd: int, path: Path) -> bool:
    """Does the descriptor read exactly the file's bytes? (Not a digest of extents: a fork's read of a hole fills the
    memfd's hole with a zero page, which changes where its data is, not what it reads.)"""
    with open(path, "rb") as f:
        if os.fstat(fd).st_size != os.fstat(f.fileno()).st_size:
            return False
        off = 0
        while chunk := f.read(4 * MiB):
            if os.pread(fd, len(chunk), off) != chunk:
                return False
            off += len(chunk)
    return True


async def test_a_forks_qemu_cannot_write_the_ram_its_siblings_map(driver: MicroVMDriver, template: TemplateRef) -> None:
    """A fork's QEMU maps its template's RAM from a sealed memfd, not from the file: as that QEMU's uid, with the very
    descriptor QEMU holds, writing, punching, truncating, mapping it shared and writable, and unsealing all fail;
    the template RAM file is root's 0400 and no QEMU holds it; siblings wake with the template's memory."""
    from moorage.sandbox import microvm_memfd
    from moorage.sandbox import microvm_ram as ram

    a, b = await driver.fork(template, ["seal-a", "seal-b"])
    await asyncio.gather(a.wake(), b.wake())
    if os.geteuid() != 0:  # an unprivileged host: QEMU runs as the host's own uid and maps the file itself
        return
    tram = template.path / "ram"
    st = tram.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o400)
    # What the QEMU holds: the memfd (by the name the driver gives it), never the file.
    name = f"/memfd:{microvm_memfd.memfd_name(tram)} (deleted)"
    links = {n: os.readlink(f"/proc/{a.pid}/fd/{n}") for n in os.listdir(f"/proc/{a.pid}/fd")}
    assert str(tram) not in links.values(), links
    held = [n for n, target in links.items() if target == name]  # the one inherited, the one QEMU opened through it
    assert held, links
    qemu_fd = held[-1]
    m = ram.find_mapping(a.pid, tram)
    maps = Path(f"/proc/{a.pid}/maps").read_text()
    assert f"{m.start:x}-{m.end:x} rw-p" in maps and name in maps and str(tram) not in maps
    fd = os.open(f"/proc/{a.pid}/fd/{qemu_fd}", os.O_RDONLY)
    try:
        assert _same_bytes(fd, tram)  # a faithful copy
        ids = _ids(a.pid)
        r = subprocess.run(["setpriv", f"--reuid={ids['uid'][0]}", f"--regid={ids['gid'][0]}",
                            f"--groups={','.join(map(str, ids['groups']))}", "--",
                            "/usr/bin/python3", "-c", _RAM_PROBE, str(fd)],
                           capture_output=True, text=True, pass_fds=[fd], timeout=30)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got == {
            "write": "EPERM", "pwrite": "EPERM", "punch hole": "EPERM", "truncate shorter": "EPERM",
            "truncate longer": "EPERM", "map shared writable": "EPERM", "remove seals": "EPERM",
            "private copy written": True, "seals": microvm_memfd.SEALS, "unchanged": True,
        }, got
        assert _same_bytes(fd, tram)
    finally:
        os.close(fd)
    # Siblings still run from the template's memory (the token lives only in the memory of a process the template
    # holds), and sleep and wake as their own copies.
    token = await ask_token(a)
    assert await ask_token(b) == token
    await a.write_file("/work/only-a.txt", b"a")
    await asyncio.gather(a.sleep(), b.sleep())
    await asyncio.gather(a.wake(), b.wake())
    assert await a.read_file("/work/only-a.txt") == b"a" and await ask_token(a) == token
    assert await out(b, ["sh", "-c", "test -e /work/only-a.txt && echo yes || echo no"]) == "no"
    assert await ask_token(b) == token
    await a.destroy()
    await b.destroy()


async def test_a_disk_header_rewritten_by_its_qemu_names_no_other_file(driver: MicroVMDriver, base: MicroVMSandbox, template: TemplateRef) -> None:
    """A sandbox's QEMU can write its own disk's qcow2 header. One that names another sandbox's disk as its backing
    file is refused before any QEMU starts, and that disk is neither handed over nor given to the attacker's uid;
    a template is never made from such a disk, and a rollback does not hand it to qemu-img."""
    from moorage.sandbox.microvm_user import VMUserError, check_backing

    (kid,) = await driver.fork(template, ["uid-tampered"])
    victim = base.dir / "disk.qcow2"
    before = victim.stat()
    subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(victim), "-F", "qcow2", str(kid.dir / "disk.qcow2")],
                   check=True, capture_output=True)
    with pytest.raises(VMUserError, match="backing file"):
        await kid.wake()
    assert kid.state is SandboxState.SLEEPING and kid.pid is None
    after = victim.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
    with pytest.raises(VMUserError):  # what make_template checks on its copy of a sandbox's disk
        check_backing(kid.dir / "disk.qcow2", kid.dir)
    # A rollback runs qemu-img (as root) on the disk, which would open that backing file: refused first.
    (kid.dir / "checkpoints" / "c").mkdir(parents=True)
    (kid.dir / "checkpoints" / "c" / "snapshot.json").write_text(json.dumps({"kind": "delta"}))
    with pytest.raises(VMUserError):
        await kid.rollback("c")
    await kid.destroy()
