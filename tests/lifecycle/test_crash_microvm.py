"""`moorage up` on the micro-VM driver SIGKILLed inside a checkpoint and inside a sleep, then started again
(tests/lifecycle/crash_up.py kills it at a chosen call): what the cut-short snapshot had written (its ``.new``
directory, a copy of the guest's memory, and a checkpoint's disk snapshot) is removed when the host next opens the
sandbox, and the instance's turns, checkpoints and rollbacks go on as before (a rollback killing the VM the dead host
left running waits until every thread of its QEMU is gone)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.postgres import free_port
from moorage.sandbox.microvm_snapshots import MAKING, sweep_unfinished
from tests.lifecycle.crash_up import Up
from tests.lifecycle.test_crash_operations import GZ, _guests_of, _in_background, _tt_archive


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path / "data", free_port(), "microvm")
    yield u
    u.stop()
    for pid in _guests_of(u.data / "sandboxes"):  # a micro-VM outlives its host by design
        os.kill(pid, signal.SIGKILL)


def _instance(up: Up) -> Path:
    (d,) = [p for p in (up.data / "sandboxes").iterdir() if not p.name.startswith((".", "tpl-"))]
    return d


def _disk_snapshots(sb: Path) -> set[str]:
    """The internal snapshots of the instance's disk (-U: its QEMU holds it)."""
    out = subprocess.run(["qemu-img", "snapshot", "-l", "-U", str(sb / "disk.qcow2")], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines()[2:] if line.strip()}


def _named(sb: Path) -> set[str]:
    """The disk snapshots a checkpoint of the sandbox names."""
    return {f"ckpt-{d.name}" for d in (sb / "checkpoints").iterdir() if (d / "snapshot.json").exists()}


def _left_over(sb: Path) -> list[Path]:
    return [p for p in [sb / "snapshot.new", *(sb / "checkpoints").glob("*.new")] if p.exists()]


def test_killed_in_a_checkpoint_and_in_a_sleep_nothing_half_made_is_left(up: Up) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/tt/invoke", json={"message": "m0", "user": "ada"}).json()["reply"] == "noted m0"
        first = c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]
    up.stop()  # the instance runs on past its host
    sb = _instance(up)

    # Killed in a checkpoint: the guest's pages read and its disk snapshotted, the files not yet stored.
    up.start("moorage.sandbox.microvm_ram_chain:write")
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/tt/users/ada/checkpoints", json={"name": "before-upgrade"}))
        assert up.died()
    left = _left_over(sb)
    assert left and all((d / "dev.state").exists() for d in left), left
    assert _disk_snapshots(sb) - _named(sb), "no disk snapshot was left unnamed"

    # Killed in a sleep, the guest's changed memory saved beside its device state, not yet put in place.
    up.start("moorage.sandbox.microvm_ram:save_delta", after=True)
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "m1", "user": "ada"}).json()["reply"] == "noted m1"
        assert len(c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]) == len(first) + 1
        assert _left_over(sb) == []
        assert _disk_snapshots(sb) == _named(sb)
        assert json.loads((sb / "meta.json").read_text())["ram_mode"] == "delta"  # a fork: its sleep saves a delta
        _in_background(lambda: c.post(f"/v1/sandboxes/{sb.name}/sleep"))
        assert up.died()
    assert (sb / "snapshot.new" / "ram.delta").exists()

    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "m2", "user": "ada"}).json()["reply"] == "noted m2"
        cks = c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]
        assert len(cks) == len(first) + 2
        assert _left_over(sb) == []
        assert _disk_snapshots(sb) == _named(sb)
        r = c.post(f"/v1/agents/tt/users/ada/checkpoints/{first[0]['id']}/rollback")
        assert r.status_code == 200, r.text
        assert c.post("/v1/agents/tt/invoke", json={"message": "m3", "user": "ada"}).json()["reply"] == "noted m3"
        assert len(c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]) == len(cks) + 2  # its own, m3's
        # Once written, no checkpoint is being made, and one put in place carries no lock file of its making.
        assert _left_over(sb) == [] and not list(sb.glob("checkpoints/*/" + MAKING))


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_snapshot_being_made_stays_and_goes_once_its_maker_is_killed(tmp_path: Path) -> None:
    new = tmp_path / "checkpoints" / "tt-1.new"
    new.mkdir(parents=True)
    done = tmp_path / "checkpoints" / "tt-0"
    done.mkdir()
    (done / "snapshot.json").write_text("{}")
    maker = subprocess.Popen([sys.executable, "-c", HOLD, str(new / MAKING)], stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None and maker.stdout.readline().strip() == "held"
        assert sweep_unfinished(tmp_path) == [] and new.is_dir()
    finally:
        maker.kill()
        maker.wait(10)
    assert sweep_unfinished(tmp_path) == [new] and not new.exists()
    assert done.is_dir()  # a checkpoint is never touched
    # One without its lock file (from a host before it) goes once it is old.
    (tmp_path / "snapshot.new").mkdir()
    assert sweep_unfinished(tmp_path) == []
    old = time.time() - 120
    os.utime(tmp_path / "snapshot.new", (old, old))
    assert sweep_unfinished(tmp_path) == [tmp_path / "snapshot.new"]


async def test_a_stopped_sandboxs_unfinished_checkpoint_loses_its_disk_snapshot_when_opened(tmp_path: Path) -> None:
    """Its QEMU gone too (the machine restarted): the disk snapshot goes through qemu-img."""
    from moorage.config import Config
    from moorage.sandbox.microvm import MicroVMDriver

    sb = tmp_path / "sandboxes" / "sb1"
    (sb / "checkpoints" / "tt-x.new").mkdir(parents=True)
    (sb / "checkpoints" / "tt-x.new" / MAKING).touch()  # its maker is gone: nobody holds the lock
    (sb / "checkpoints" / "tt-y").mkdir()
    (sb / "checkpoints" / "tt-y" / "snapshot.json").write_text("{}")
    (sb / "meta.json").write_text(json.dumps({"id": "sb1", "state": "sleeping", "pid": None, "ram_mode": "shared",
                                              "template_dir": None, "image_dir": str(tmp_path / "images" / "i")}))
    disk = str(sb / "disk.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", disk, "1M"], check=True)
    for tag in ("ckpt-tt-x", "ckpt-tt-y"):
        subprocess.run(["qemu-img", "snapshot", "-c", tag, disk], check=True)
    driver = MicroVMDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path), images_dir=tmp_path / "images")
    await driver.open("sb1")
    assert _disk_snapshots(sb) == {"ckpt-tt-y"} == _named(sb)
    assert _left_over(sb) == []


async def test_a_checkpoint_name_a_restarted_host_would_sweep_is_refused(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from moorage.errors import InvalidInput
    from moorage.sandbox.microvm_sandbox import MicroVMSandbox

    sb = MicroVMSandbox(SimpleNamespace(root=tmp_path), "sb1", {"state": "running"})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="does not end in .new or .old"):
        await sb.checkpoint("nightly.new")
    assert not (tmp_path / "sb1" / "checkpoints").exists()


LEADER_GONE = """
import ctypes, fcntl, os, sys, threading, time
if os.fork():
    os._exit(0)  # the holder is not the test's child: as a QEMU left by a host that died
held = threading.Event()
def hold():
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    time.sleep(600)
threading.Thread(target=hold).start()
held.wait()
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
ctypes.CDLL(None).pthread_exit(None)  # its main thread ends (a zombie), the other one holds the lock on
"""


def test_a_qemu_left_by_a_dead_host_is_gone_with_every_thread_before_its_disk_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollback of a VM re-attached after a crash killed its QEMU (not the host's child) and went on once its
    main thread was a zombie: its other threads, still exiting (a large guest's memory being unmapped), held the
    disk's lock, and ``qemu-img snapshot -a`` failed 'Failed to get "write" lock' (a 500)."""
    from moorage.sandbox import microvm_qemu

    lock, pidfile = tmp_path / "disk.lock", tmp_path / "pid"
    subprocess.run([sys.executable, "-c", LEADER_GONE, str(lock), str(pidfile)], check=True)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    real_kill = os.kill
    # The kill lands a moment later, as the exit of a QEMU whose threads unmap a large guest's memory.
    monkeypatch.setattr(os, "kill", lambda p, s: threading.Timer(0.5, real_kill, (p, s)).start())
    microvm_qemu.kill_pid(pid, timeout=10)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its files are closed: the lock is free
    finally:
        os.close(fd)


def test_killed_while_retention_deletes_a_checkpoint_its_disk_snapshot_goes_at_the_next_start(up: Up) -> None:
    """Its record removed and the disk snapshot not yet: nothing deleted that disk snapshot again (its row was
    pruned), and its clusters stayed in the disk for good."""
    import httpx

    from tests.lifecycle.test_crash_operations import _archive, TT_AGENT

    keep2 = _archive("tt", TT_AGENT, '[agent.timetravel]\nauto = true\nkeep = 2\ndaily = 0\n'
                                     '[agent.lifecycle]\nusers = "auto"\n')
    up.start("moorage.sandbox.microvm_checkpointing:fsync_dir", after=True)
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=keep2, headers=GZ).status_code == 201
        for n in range(15):  # retention runs at the 10th checkpoint
            try:
                c.post("/v1/agents/tt/invoke", json={"message": f"m{n}", "user": "ada"})
            except httpx.HTTPError:
                break
        assert up.died()
    sb = _instance(up)
    assert _disk_snapshots(sb) - _named(sb), "no disk snapshot was left unnamed"
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "again", "user": "ada"}).json()["reply"] == "noted again"
        c.get("/v1/agents/tt/users/ada/checkpoints")  # its checkpoint written
        assert _disk_snapshots(sb) == _named(sb)


def test_killed_between_the_renames_of_a_sleeps_snapshot_the_next_start_settles_it(up: Up) -> None:
    """A sleep replacing the last one's ``snapshot/`` moves it aside as ``snapshot.old`` and renames the new one in:
    killed in between, neither was in place, and the next start left ``snapshot.old`` (a copy of the guest's
    memory) for good. It now puts the whole new one in place and removes the old."""
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/tt/invoke", json={"message": "m0", "user": "ada"}).json()["reply"] == "noted m0"
        sb = _instance(up)
        assert c.post(f"/v1/sandboxes/{sb.name}/sleep").status_code == 200
        assert c.post("/v1/agents/tt/invoke", json={"message": "m1", "user": "ada"}).json()["reply"] == "noted m1"
        c.get("/v1/agents/tt/users/ada/checkpoints")  # the turn's checkpoint written
    up.stop()
    assert (sb / "snapshot" / "dev.state").exists()  # the next sleep replaces it

    up.start("os:rename", crash_if="snapshot.new")  # the second rename: the old one already aside
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "m2", "user": "ada"}).json()["reply"] == "noted m2"
        assert (sb / "snapshot" / "dev.state").exists()  # awake, its last sleep's snapshot still there
        slept = _in_background(lambda: c.post(f"/v1/sandboxes/{sb.name}/sleep"))
        assert up.died(), (slept, up.log.read_text()[-3000:])
    assert (sb / "snapshot.old").is_dir() and (sb / "snapshot.new" / "dev.state").exists()
    assert not (sb / "snapshot").exists()

    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "m3", "user": "ada"}).json()["reply"] == "noted m3"
        assert (sb / "snapshot" / "dev.state").exists()  # the whole new one, put in place when it was opened
        assert not (sb / "snapshot.old").exists() and not (sb / "snapshot.new").exists()
        assert c.post(f"/v1/sandboxes/{sb.name}/sleep").status_code == 200
        assert c.post("/v1/agents/tt/invoke", json={"message": "m4", "user": "ada"}).json()["reply"] == "noted m4"
        assert not list(sb.glob("snapshot.*")) and not list(sb.glob("checkpoints/*.old"))


SWAP = """
import os, signal, sys
from pathlib import Path
from moorage.sandbox import microvm_snapshots as s
real = os.rename
def rename(a, b):
    if str(a).endswith(".new"):
        os.kill(os.getpid(), signal.SIGKILL)  # between the two renames
    real(a, b)
os.rename = rename
new = Path(sys.argv[1])
fd = s.begin(new)
(new / "dev.state").write_text("new")
(new / "snapshot.json").write_text("{}")
if sys.argv[2] == "half":
    os.kill(os.getpid(), signal.SIGKILL)  # killed while it is made: no swap began
s.swap_in(new, new.with_name(new.name[:-4]))
"""


@pytest.mark.parametrize("cut", ["whole", "aside-only"])
def test_a_checkpoint_replaced_when_killed_between_its_renames_is_never_lost(tmp_path: Path, cut: str) -> None:
    """``checkpoints/<name>`` replaced (``swap_in``) and the host SIGKILLed between moving the old one aside and
    renaming the new one in: the next open puts the whole new one in place, or the old one back when no whole
    new one is left (the sweep of ``.new`` directories ran first, before this fix)."""
    cps = tmp_path / "checkpoints"
    (cps / "tt-1").mkdir(parents=True)
    (cps / "tt-1" / "dev.state").write_text("old")
    (cps / "tt-1" / "snapshot.json").write_text("{}")
    r = subprocess.run([sys.executable, "-c", SWAP, str(cps / "tt-1.new"), "whole"],
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == -signal.SIGKILL
    assert not (cps / "tt-1").exists() and (cps / "tt-1.old").is_dir()
    if cut == "aside-only":  # the new one gone meanwhile (removed by hand, or not whole): the old one comes back
        import shutil

        shutil.rmtree(cps / "tt-1.new")
    sweep_unfinished(tmp_path)
    assert (cps / "tt-1" / "dev.state").read_text() == ("new" if cut == "whole" else "old")
    assert sorted(p.name for p in cps.iterdir()) == ["tt-1"]


def test_a_checkpoint_being_replaced_when_killed_keeps_the_old_one(tmp_path: Path) -> None:
    cps = tmp_path / "checkpoints"
    (cps / "tt-1").mkdir(parents=True)
    (cps / "tt-1" / "dev.state").write_text("old")
    r = subprocess.run([sys.executable, "-c", SWAP, str(cps / "tt-1.new"), "half"],
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == -signal.SIGKILL
    sweep_unfinished(tmp_path)
    assert (cps / "tt-1" / "dev.state").read_text() == "old"
    assert sorted(p.name for p in cps.iterdir()) == ["tt-1"]
