"""The sandbox conformance suite: every driver in ``DRIVER_FACTORIES`` must pass all of it.

Capability-gated behaviour is asserted both ways: a driver that declares a capability must deliver it, and one
that does not must not pretend to (so nothing here is ever skipped).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import struct
import uuid
import zipfile
from pathlib import Path
from typing import Callable

import pytest

from moorage.errors import InvalidInput
from moorage.sandbox import (
    GuestFileNotFound,
    Sandbox,
    SandboxDriver,
    SandboxSpec,
    SandboxState,
    SandboxStateError,
    SnapshotIncompatible,
    TemplateRef,
)
from moorage.sandbox.channel import encode_frame

PY = "python3"
#: Limits small enough that the abuse tests finish quickly and bounded.
TIGHT = SandboxSpec(memory_mib=128, disk_mib=48, max_processes=48, max_file_mib=16)


async def started(driver: SandboxDriver, sid: str, spec: SandboxSpec | None = None) -> Sandbox:
    sb = await driver.create(sid, spec)
    assert sb.state is SandboxState.CREATED
    await sb.start()
    assert sb.state is SandboxState.RUNNING
    return sb


async def sh(sb: Sandbox, script: str, timeout: float = 60) -> str:
    r = await sb.exec(["/bin/sh", "-c", script], timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, (r.exit_code, r.stdout_text, r.stderr_text)
    return r.stdout_text


# --- exec and files -------------------------------------------------------------------------------------------


async def test_exec_streams_output_exit_code_and_timeout(driver: SandboxDriver) -> None:
    sb = await started(driver, "ex")
    chunks: list[tuple[str, bytes]] = []
    r = await sb.exec(
        ["/bin/sh", "-c", "echo one; echo two >&2; printf '\\000\\377'; exit 7"],
        on_output=lambda stream, data: chunks.append((stream, data)),
    )
    assert r.exit_code == 7 and not r.timed_out
    assert r.stdout == b"one\n\x00\xff" and r.stderr == b"two\n"
    assert b"".join(d for s, d in chunks if s == "stdout") == r.stdout
    r = await sb.exec(["/bin/sh", "-c", "echo before; sleep 30"], timeout=1)
    assert r.timed_out and r.stdout == b"before\n" and not r.ok
    r = await sb.exec(["cat"], stdin=b"fed via stdin", cwd="/tmp", env={"X": "1"})
    assert r.stdout == b"fed via stdin"
    assert (await sb.exec(["/bin/sh", "-c", 'echo "$X $PWD"'], cwd="/tmp", env={"X": "1"})).stdout == b"1 /tmp\n"
    # A relative cwd is in the working directory (as the files API's paths are); a missing one is named as such,
    # not reported as a missing command.
    workdir = (await sb.exec(["pwd"])).stdout.decode().strip()
    await sb.exec(["mkdir", "-p", "projects"])
    assert (await sb.exec(["pwd"], cwd="projects")).stdout.decode().strip() == workdir + "/projects"
    with pytest.raises(InvalidInput, match="cwd /nonexistent is not a directory"):
        await sb.exec(["/bin/sh", "-c", "true"], cwd="/nonexistent")


async def test_clean_environment_never_leaks_host_secrets(driver: SandboxDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOORAGE_TEST_HOST_SECRET", "s3cr3t-host-value")
    sb = await started(driver, "envsb", SandboxSpec(env={"AGENT_SETTING": "on"}))
    out = await sh(sb, "env")
    assert "s3cr3t-host-value" not in out
    assert "AGENT_SETTING=on" in out


async def test_files_write_read_list_stat(driver: SandboxDriver) -> None:
    sb = await started(driver, "files")
    big = os.urandom(3 * 1024 * 1024 + 17)  # crosses the 1 MiB chunking several times
    await sb.write_file("data/big.bin", big)
    await sb.write_file("data/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert await sb.read_file("data/big.bin") == big
    assert await sb.read_file("/work/data/big.bin") == big
    entries = {e.name: e for e in await sb.list_files("data")}
    assert set(entries) == {"big.bin", "run.sh"}
    assert entries["big.bin"].size == len(big) and entries["big.bin"].type == "file"
    assert entries["run.sh"].mode == 0o755
    assert (await sb.exec(["/work/data/run.sh"])).stdout == b"ran\n"
    assert (await sh(sb, "sha256sum data/big.bin")).split()[0] == hashlib.sha256(big).hexdigest()
    info = await sb.stat("data")
    assert info is not None and info.type == "dir"
    assert await sb.stat("data/missing") is None
    with pytest.raises(GuestFileNotFound):
        await sb.read_file("data/missing")
    with pytest.raises(GuestFileNotFound):
        await sb.list_files("nowhere")


# --- persistence ------------------------------------------------------------------------------------------------


async def test_files_survive_sleep_wake_and_host_restart(make_driver: Callable[[], SandboxDriver]) -> None:
    d1 = make_driver()
    sb = await started(d1, "persist")
    await sb.write_file("notes.txt", b"remember me")
    await sh(sb, "mkdir -p deep/dir && echo nested > deep/dir/f")
    snap = await sb.sleep()
    assert sb.state is SandboxState.SLEEPING and snap.bytes > 0
    with pytest.raises(SandboxStateError):
        await sb.exec(["true"])
    await sb.wake()
    assert await sb.read_file("notes.txt") == b"remember me"

    # "Host restart" while running: a new driver instance re-adopts the sandbox from disk.
    d2 = make_driver()
    assert "persist" in await d2.list()
    again = await d2.open("persist")
    assert again.state in (SandboxState.RUNNING, SandboxState.STOPPED, SandboxState.SLEEPING)
    if again.state is not SandboxState.RUNNING:
        await again.wake()
    assert await again.read_file("deep/dir/f") == b"nested\n"

    # And a restart while asleep comes back asleep.
    await again.sleep()
    d3 = make_driver()
    third = await d3.open("persist")
    assert third.state is SandboxState.SLEEPING
    await third.wake()
    assert await third.read_file("notes.txt") == b"remember me"


async def test_a_stopped_sandbox_sleeps_as_its_disk_and_wakes_from_it(make_driver: Callable[[], SandboxDriver]) -> None:
    """A sandbox that stopped under its instance (its guest exited or was killed, or the host stopped it) sleeps:
    sleep() from STOPPED used to raise SandboxStateError, and every idle sleep of such an instance failed."""
    sb = await started(make_driver(), "stopped-sleeps")
    await sb.write_file("kept.txt", b"on disk")
    await sb.stop()
    assert sb.state is SandboxState.STOPPED
    snap = await sb.sleep()
    assert sb.state is SandboxState.SLEEPING and not snap.includes_memory
    again = await make_driver().open("stopped-sleeps")  # recorded asleep on disk, not only in this process
    assert again.state is SandboxState.SLEEPING
    await again.wake()
    assert again.state is SandboxState.RUNNING
    assert await again.read_file("kept.txt") == b"on disk"
    assert getattr(again, "last_wake_fallback", None) is None  # a boot from its disk, not a snapshot found broken
    fresh = await make_driver().create("never-started")
    with pytest.raises(SandboxStateError):  # a sandbox that never ran has nothing to sleep
        await fresh.sleep()


async def test_a_sandbox_starts_with_the_environment_it_is_given(driver: SandboxDriver) -> None:
    """``set_boot_env`` (a redeploy's instance takes the new deployment's environment): from the next start, its
    processes get the new environment instead of the one it was created with; a running sandbox keeps its own.
    (One boot here; a stopped instance given a new one and started again: tests/runtime/test_shared_packages_up.py,
    tests/egress/test_vm_network.py.)"""
    sb = await driver.create("env", SandboxSpec(env={"OLD": "1"}))
    assert driver.boot_env(sb) == {"OLD": "1"}
    await driver.set_boot_env(sb, {"NEW": "2"})
    assert driver.boot_env(sb) == {"NEW": "2"}
    await sb.start()
    assert (await sh(sb, 'echo "${OLD:-none} $NEW"')).strip() == "none 2"
    with pytest.raises(SandboxStateError):
        await driver.set_boot_env(sb, {"NEWER": "3"})
    assert driver.boot_env(sb) == {"NEW": "2"}

    # ``restart_in_place`` (a micro-VM's supervisor executes itself afresh; the process driver cannot): every process
    # ends and the new ones have the new environment, or nothing changes and the caller stops and starts it.
    await sh(sb, "nohup sleep 600 >/dev/null 2>&1 & echo $! > bg.pid")
    done = await driver.restart_in_place(sb, {"NEWER": "3"})
    assert done is (driver.name == "microvm")
    alive = (await sh(sb, "kill -0 $(cat bg.pid) 2>/dev/null && echo alive || echo gone")).strip()
    env = (await sh(sb, 'echo "${NEW:-none} ${NEWER:-none}"')).strip()
    if done:
        assert (alive, env, driver.boot_env(sb)) == ("gone", "none 3", {"NEWER": "3"})
    else:
        assert (alive, env, driver.boot_env(sb)) == ("alive", "2 none", {"NEW": "2"})


def _make_wheel(tmp: Path) -> Path:
    """A minimal pure-Python wheel built here on the host (no network, no build backend)."""
    name, version = "moorage_canary_pkg", "1.0"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b'VALUE = "from-the-wheel"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: moorage-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{path},sha256={digest},{len(data)}\n")
    record.write(f"{dist}/RECORD,,\n")
    files[f"{dist}/RECORD"] = record.getvalue().encode()
    out = tmp / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


async def test_installed_wheel_survives_sleep_and_is_in_forks(driver: SandboxDriver, tmp_path: Path) -> None:
    wheel = _make_wheel(tmp_path)
    sb = await started(driver, "pip")
    await sb.write_file(wheel.name, wheel.read_bytes())
    await sh(sb, f"{PY} -m pip install --no-index --no-cache-dir --user --break-system-packages ./{wheel.name}", timeout=120)
    check = f"{PY} -c 'import moorage_canary_pkg as m; print(m.VALUE)'"
    assert (await sh(sb, check)).strip() == "from-the-wheel"
    await sb.sleep()
    await sb.wake()
    assert (await sh(sb, check)).strip() == "from-the-wheel"
    tpl = await driver.make_template(sb)
    (child,) = await driver.fork(tpl, ["pip-child"])
    await child.start()
    assert (await sh(child, check)).strip() == "from-the-wheel"


async def test_forks_are_independent(driver: SandboxDriver) -> None:
    base = await started(driver, "tpl-src")
    await base.write_file("shared.txt", b"from template")
    await base.write_file("pkgs/mod.py", b"VALUE = 1\n")  # what forks never write (an agent's packages)
    tpl = await driver.make_template(base, shared=["/work/pkgs"])
    assert isinstance(tpl, TemplateRef) and tpl.driver == driver.name
    kids = await driver.fork(tpl, ["kid-a", "kid-b"])
    assert [k.id for k in kids] == ["kid-a", "kid-b"]
    for k in kids:
        await k.start()
        assert await k.read_file("shared.txt") == b"from template"
    await kids[0].write_file("shared.txt", b"changed in a")
    await kids[0].write_file("only-a.txt", b"a")
    assert await kids[1].read_file("shared.txt") == b"from template"
    assert await kids[1].stat("only-a.txt") is None
    assert await base.read_file("shared.txt") == b"from template"
    assert await base.stat("only-a.txt") is None
    # A fresh fork after the children changed things still sees the template as it was.
    (kid_c,) = await driver.fork(tpl, ["kid-c"])
    await kid_c.start()
    assert await kid_c.read_file("shared.txt") == b"from template"
    # A sandbox created from the template directly behaves like a fork.
    direct = await driver.create("kid-direct", template=tpl)
    await direct.start()
    assert await direct.read_file("shared.txt") == b"from template"
    await driver.delete_template(tpl)
    # A fork reads what the template shares for as long as it lives, the template deleted or not.
    await kids[1].sleep()
    await kids[1].wake()
    for k in (*kids, kid_c, direct):
        assert await k.read_file("/work/pkgs/mod.py") == b"VALUE = 1\n"
    # A redeploy's packages for a fork that exists (``bind_shared``): a driver whose forks bind what their template
    # shares binds another template's from the next start; one whose forks own their files binds nothing (the
    # runtime installs into such a fork instead: runtime/instance_update.py).
    if not driver.capabilities.shares_template_dirs:
        assert await driver.bind_shared(kids[1], tpl) == []
        return
    await kids[1].write_file("mine.txt", b"b's")
    await kids[1].sleep()
    await base.write_file("pkgs/mod.py", b"VALUE = 2\n")
    tpl2 = await driver.make_template(base, shared=["/work/pkgs"])
    assert await driver.bind_shared(kids[1], tpl2) == ["/work/pkgs"]
    await kids[1].wake()
    assert await kids[1].read_file("/work/pkgs/mod.py") == b"VALUE = 2\n"
    assert await kids[1].read_file("mine.txt") == b"b's"


async def _up(sb: Sandbox) -> None:
    """A fork running: restored from its template's snapshot where the driver has one, else started."""
    if sb.state is SandboxState.CREATED:
        await sb.start()
    else:
        await sb.wake()


async def test_a_standalone_template_of_a_fork_needs_nothing_of_the_template_the_fork_came_from(
        driver: SandboxDriver) -> None:
    """A deployment's template is made from a fork of the booted image (``runtime/templates.py``): it must stay
    usable, and publishable, once that template is deleted."""
    src = await started(driver, "boot-src")
    await src.write_file("from-boot.txt", b"boot")
    boot = await driver.make_template(src)
    await src.destroy()
    (kid,) = await driver.fork(boot, ["boot-kid"])
    await _up(kid)
    await kid.write_file("from-kid.txt", b"kid")
    tpl = await driver.make_template(kid, standalone=True)
    await kid.destroy()
    await driver.delete_template(boot)
    assert not Path(boot.path).exists()  # nothing forks from it any more: its files went
    (grand,) = await driver.fork(tpl, ["boot-grand"])
    await _up(grand)
    assert await grand.read_file("from-boot.txt") == b"boot"
    assert await grand.read_file("from-kid.txt") == b"kid"
    await grand.write_file("from-grand.txt", b"grand")
    await grand.sleep()
    await grand.wake()
    assert await grand.read_file("from-grand.txt") == b"grand"


async def test_templates_from_another_driver_are_rejected(driver: SandboxDriver, tmp_path: Path) -> None:
    foreign = TemplateRef("foreign", "some-other-driver", tmp_path)
    with pytest.raises(SnapshotIncompatible):
        await driver.fork(foreign, ["never"])


_BACKGROUND = r"""
import os, sys, time, signal
token = os.urandom(8).hex()
def dump(*_):
    with open("/work/token.out", "w") as f:
        f.write(token)
signal.signal(signal.SIGUSR1, dump)
with open("/work/bg.pid", "w") as f:
    f.write(str(os.getpid()))
dump()
while True:
    time.sleep(1)
"""

_FIND_MARKED = r"""
import os, sys
hits = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            if b"moorage-bg-marker" in open("/proc/%s/cmdline" % p, "rb").read():
                hits.append(p)
        except OSError:
            pass
print(" ".join(hits))
"""


async def _start_background(sb: Sandbox) -> str:
    await sb.write_file("bg.py", _BACKGROUND.encode())
    await sb.write_file("find.py", _FIND_MARKED.encode())
    await sh(sb, f"nohup {PY} bg.py moorage-bg-marker >/dev/null 2>&1 &")
    for _ in range(200):
        if await sb.stat("token.out") is not None and await sb.stat("bg.pid") is not None:
            if token := (await sb.read_file("token.out")).decode():  # written, not just opened
                return token
        await asyncio.sleep(0.05)
    return (await sb.read_file("token.out")).decode()


async def _background_token(sb: Sandbox) -> str | None:
    """The token held in memory by the background process, or None when it is not running."""
    if not (await sh(sb, f"{PY} find.py")).strip():
        return None
    await sh(sb, "rm -f token.out; kill -USR1 $(cat bg.pid)")
    for _ in range(200):
        if await sb.stat("token.out") is not None:
            data = (await sb.read_file("token.out")).decode()
            if data:  # the process may have opened (truncated) the file but not written it yet
                return data
        await asyncio.sleep(0.05)
    return None


async def test_processes_across_sleep_match_capability(driver: SandboxDriver) -> None:
    sb = await started(driver, "bg")
    token = await _start_background(sb)
    await sb.sleep()
    await sb.wake()
    if driver.capabilities.keeps_processes_across_sleep:
        assert await _background_token(sb) == token  # same process, memory intact
    else:
        assert await _background_token(sb) is None


async def test_rollback_restores_files_and_memory_per_capability(driver: SandboxDriver) -> None:
    sb = await started(driver, "rb")
    await sb.write_file("a.txt", b"v1")
    token = await _start_background(sb)
    ck = await sb.checkpoint("c1")
    assert ck.name == "c1" and ck.includes_memory == driver.capabilities.memory_snapshot
    await sb.write_file("a.txt", b"v2")
    await sb.write_file("b.txt", b"new")
    await sh(sb, "kill $(cat bg.pid)")
    await sb.rollback("c1")
    assert sb.state is SandboxState.RUNNING
    assert await sb.read_file("a.txt") == b"v1"
    assert await sb.stat("b.txt") is None
    if driver.capabilities.memory_snapshot:
        assert await _background_token(sb) == token
    else:
        assert await _background_token(sb) is None
    # The checkpoint is reusable and listed; a sleeping sandbox can be rolled back too.
    await sb.write_file("a.txt", b"v3")
    await sb.sleep()
    await sb.rollback("c1")
    await sb.wake()
    assert await sb.read_file("a.txt") == b"v1"
    assert [c.name for c in await sb.checkpoints()] == ["c1"]


async def test_a_stopped_sandbox_slept_then_rolled_back_has_its_checkpoint_s_memory(driver: SandboxDriver) -> None:
    """A sandbox asleep as its disk (stopped, then slept) boots from that disk at its next wake; that must not stick
    to it once it has a memory image again: rolled back to a checkpoint, it resumes the checkpoint's memory, and
    after its next ordinary sleep its own snapshot's."""
    sb = await started(driver, "stopped-rb")
    token = await _start_background(sb)
    await sb.checkpoint("c1")
    await sb.stop()
    await sb.sleep()
    await sb.rollback("c1")
    if sb.state is not SandboxState.RUNNING:  # a driver may leave a sleeping sandbox asleep at its rollback
        await sb.wake()
    held = token if driver.capabilities.memory_snapshot else None
    assert await _background_token(sb) == held
    await sb.sleep()
    await sb.wake()
    assert await _background_token(sb) == (held if driver.capabilities.keeps_processes_across_sleep else None)


async def test_destroy_removes_everything(driver: SandboxDriver) -> None:
    sb = await started(driver, "gone")
    await sb.write_file("x", b"x")
    await sb.checkpoint("c")
    await sb.destroy()
    assert sb.state is SandboxState.DESTROYED
    assert "gone" not in await driver.list()
    assert not (driver.root / "gone").exists()


async def test_stats_report_state_memory_and_disk(driver: SandboxDriver) -> None:
    sb = await started(driver, "st")
    await sb.write_file("blob", os.urandom(2 << 20))
    s = await sb.stats()
    assert s.state is SandboxState.RUNNING and s.host_rss_bytes > 0 and s.disk_bytes >= 2 << 20
    await sb.sleep()
    s = await sb.stats()
    assert s.state is SandboxState.SLEEPING and s.host_rss_bytes == 0 and s.disk_bytes >= 2 << 20


# --- isolation ------------------------------------------------------------------------------------------------


async def test_guest_cannot_reach_host_files_other_sandboxes_or_host_network(driver: SandboxDriver, tmp_path: Path) -> None:
    canary = tmp_path / f"host-canary-{uuid.uuid4().hex}"
    canary.write_text("host secret")
    hits: list[bytes] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(b"connected")
        w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        a = await started(driver, "iso-a")
        b = await started(driver, "iso-b")
        await b.write_file("secret.txt", b"b's secret")
        other_disk = driver.root / "iso-b"
        # A driver with its own kernel has its own /etc/shadow and /root: reading those is not reaching the host.
        host_only = [] if driver.capabilities.own_kernel else ["/etc/shadow", "/root/.bashrc"]
        probe = f"""
import socket, sys
results = []
for path in [{str(canary)!r}, {str(other_disk)!r} + "/layer/work/secret.txt"] + {host_only!r}:
    try:
        open(path).read(); results.append("READ " + path)
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close(); results.append("TCP-CONNECTED")
except OSError:
    pass
print("|".join(results) or "ISOLATED")
"""
        await a.write_file("probe.py", probe.encode())
        out = (await sh(a, f"{PY} probe.py")).strip()
        assert out == "ISOLATED"
        assert hits == []
        # The other sandbox's own file is where it should be, untouched.
        assert await b.read_file("secret.txt") == b"b's secret"
    finally:
        server.close()
        await server.wait_closed()


async def test_fork_bomb_is_contained(driver: SandboxDriver) -> None:
    bomb = await started(driver, "bomb", TIGHT)
    other = await started(driver, "bystander")
    script = """
import os, time
n = 0
end = time.time() + 10
while time.time() < end and n < 5000:
    try:
        if os.fork() == 0:
            time.sleep(4)
            os._exit(0)
        n += 1
    except OSError:
        print("LIMITED", n)
        break
else:
    print("UNLIMITED", n)
"""
    await bomb.write_file("bomb.py", script.encode())
    r = await bomb.exec([PY, "bomb.py"], timeout=30)
    assert r.stdout_text.startswith("LIMITED"), r.stdout_text
    assert int(r.stdout_text.split()[1]) <= TIGHT.max_processes
    # The bystander sandbox and the host keep working while the bomb's children are still alive.
    assert (await other.exec(["/bin/sh", "-c", "for i in 1 2 3 4 5 6 7 8; do true & done; wait; echo ok"])).stdout == b"ok\n"
    host = await asyncio.create_subprocess_exec("true")
    assert await host.wait() == 0
    assert (await bomb.ping())["pong"]


#: Leaves the sandbox exactly one free process slot, held by sleeping children until it is killed. The process
#: ``exec`` started returns at once (so the supervisor has reaped it, and ended whatever watched it, before the
#: slots are taken); the holder then forks until the limit refuses it, several times over (slots freed late are
#: taken too), and lets one child go.
HOLD_ALL_BUT_ONE = """
import os, signal, sys, time
r, w = os.pipe()
if os.fork():
    os.close(w)
    os.read(r, 1)
    sys.exit(0)
parent = os.getppid()
os.setsid()
os.write(w, b"x")
while os.getppid() == parent:
    time.sleep(0.02)
kids, refused = [], 0
while refused < 5:
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        time.sleep(0.2)
        continue
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    kids.append(pid)
    refused = 0
os.kill(kids[-1], signal.SIGKILL)
os.waitpid(kids[-1], 0)
with open("held.tmp", "w") as f:
    f.write("%d %d" % (len(kids) - 1, os.getpgrp()))
os.rename("held.tmp", "held")
time.sleep(120)
"""


async def test_exec_needs_one_process_slot_only(driver: SandboxDriver) -> None:
    # A command started when the sandbox has one process slot left runs and is waited for: the guest watches its
    # children without starting a thread (a task, to the pids limit) for each one, so exec does not fail with
    # "can't start new thread" beside a fork bomb.
    sb = await started(driver, "lastslot", TIGHT)
    await sb.write_file("hold.py", HOLD_ALL_BUT_ONE.encode())
    assert (await sb.exec([PY, "hold.py"], timeout=30)).exit_code == 0
    for _ in range(300):
        try:
            held, group = (int(x) for x in (await sb.read_file("held")).split())
            break
        except GuestFileNotFound:
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the holder never took the slots")
    assert 0 < held < TIGHT.max_processes
    r = await sb.exec(["/bin/sh", "-c", "echo last slot; exit 3"], timeout=30)
    assert (r.exit_code, r.stdout) == (3, b"last slot\n"), (r.exit_code, r.stdout_text, r.stderr_text)
    # ...and again, the slot it used being free once more.
    assert (await sb.exec(["/bin/sh", "-c", "echo again"], timeout=30)).stdout == b"again\n"
    await sb.exec([PY, "-c", "import os; os.killpg(%d, 9)" % group], timeout=30)
    assert (await sb.exec(["echo", "usable"], timeout=30)).stdout == b"usable\n"


async def test_memory_hog_is_contained(driver: SandboxDriver) -> None:
    hog = await started(driver, "hog", TIGHT)
    other = await started(driver, "bystander2")
    # Tries to hold 2 GiB in 1 MiB pieces; must die or fail long before that.
    script = "x = []\nfor i in range(2048):\n    x.append(bytearray(1 << 20))\nprint('ALLOCATED ALL')\n"
    await hog.write_file("hog.py", script.encode())
    r = await hog.exec([PY, "hog.py"], timeout=60)
    assert not r.ok and b"ALLOCATED ALL" not in r.stdout
    assert (await other.exec(["echo", "alive"])).stdout == b"alive\n"
    # The hog's sandbox itself is still usable (only the hog died) or can be woken again.
    if hog.state is SandboxState.RUNNING:
        assert (await hog.exec(["echo", "still here"])).stdout == b"still here\n"
    else:
        await hog.wake()
        assert (await hog.exec(["echo", "back"])).stdout == b"back\n"


async def test_disk_filling_loop_is_contained(driver: SandboxDriver) -> None:
    filler = await started(driver, "filler", TIGHT)
    other = await started(driver, "bystander3")
    # Writes at most 1 GiB in 1 MiB files (each fsynced); the quota is 48 MiB.
    script = """
import os
os.makedirs("fill", exist_ok=True)
chunk = b"x" * (1 << 20)
for i in range(1024):
    with open("fill/%d" % i, "wb") as f:
        f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
print("WROTE ALL")
"""
    await filler.write_file("fill.py", script.encode())
    r = await filler.exec([PY, "fill.py"], timeout=120)
    assert not r.ok and b"WROTE ALL" not in r.stdout
    s = await filler.stats()
    assert s.disk_bytes < 1 << 30
    # A single file is capped too (RLIMIT_FSIZE at max_file_mib).
    r = await filler.exec([PY, "-c", "open('one','wb').write(b'y' * (40 << 20))"], timeout=60)
    assert not r.ok
    assert (await other.exec(["echo", "fine"])).stdout == b"fine\n"
    # The owner can still clean up (through the supervisor, which is never a quota victim) and carry on.
    if filler.state is not SandboxState.RUNNING:
        await filler.wake()
    await filler.remove("fill", recursive=True)
    if await filler.stat("one") is not None:
        await filler.remove("one")
    assert await filler.stat("fill") is None
    assert (await filler.exec(["echo", "clean"])).stdout == b"clean\n"


async def test_guest_rejects_malformed_host_frames_and_keeps_serving(driver: SandboxDriver) -> None:
    sb = await started(driver, "frames")
    ch = sb.channel
    bad = b"{this is not json"
    ch._writer.write(struct.pack(">I", len(bad)) + bad)
    ch._writer.write(encode_frame({"id": "x", "method": ["not", "a", "string"]}))
    ch._writer.write(encode_frame({"id": 424242, "result": "answer to nothing"}))
    await ch._writer.drain()
    assert (await sb.ping())["pong"]
    assert (await sb.exec(["echo", "ok"])).stdout == b"ok\n"
