"""A micro-VM whose disk write finds the host's disk full: QEMU pauses the guest (nothing written, nothing lost).
The turn that was waiting on it answers 507 ``disk-full`` at once (it waited out its 10-minute timeout, and the
guest stayed paused after room was made: every later turn of that user hung until the host restarted), and once
there is room the guest resumes by itself and the user's agent goes on where it was."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def test_a_guest_paused_by_a_full_disk_fails_its_turn_507_and_resumes_once_there_is_room(
        vm_host: tuple[Up, SmallDisk]) -> None:
    up, disk = vm_host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(disk_mib=64), headers=GZ).status_code == 201
        for n in (1, 2):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == f"{n}: hi"
        answers: list[httpx.Response | Exception] = []

        def turn() -> None:  # writes 8 MiB to its disk 2 s into the turn: by then the host's disk is full
            try:
                answers.append(c.post("/v1/agents/echo/invoke", json={"message": "fill 8 after 2", "user": "ada"},
                                      timeout=30))
            except Exception as e:  # noqa: BLE001 - the old behaviour: no answer
                answers.append(e)

        writer = threading.Thread(target=turn)
        writer.start()
        time.sleep(0.5)
        disk.fill()
        writer.join()
        (r,) = answers
        assert isinstance(r, httpx.Response) and r.status_code == 507, r
        assert r.json()["type"].endswith("/disk-full"), r.text
        # Still full: the paused guest's user is told so at once, not left waiting.
        started = time.monotonic()
        r = c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=30)
        assert r.status_code == 507 and time.monotonic() - started < 5, r.text
        disk.free()
        deadline = time.monotonic() + 10
        while (r := c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=30)).status_code \
                == 507 and time.monotonic() < deadline:
            time.sleep(0.2)  # the host resumes the guest within a moment of there being room
        assert r.status_code == 200 and r.json()["reply"] == "3: hi", r.text
        sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
        assert c.post(f"/v1/sandboxes/{sid}/sleep").json()["slept"] is True  # its snapshot is written now
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "4: hi"


def test_a_sleep_whose_snapshot_finds_the_disk_full_leaves_the_guest_running_and_no_half_snapshot(
        vm_host: tuple[Up, SmallDisk]) -> None:
    """The snapshot of a sleep did not fit: the sleep failed, and left the guest paused (every later turn of that user
    waited out its timeout, also once there was room) and its half-written ``snapshot.new`` holding the space."""
    up, disk = vm_host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(disk_mib=64), headers=GZ).status_code == 201
        for n in (1, 2):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == f"{n}: hi"
        sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
        # Nothing of the guest's files waits to be written (that would pause it, above): only the snapshot is big.
        assert c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sync"]}).json()["exit_code"] == 0
        disk.leave(256 << 10)  # room for the store's writes, not for the sleep's memory image
        r = c.post(f"/v1/sandboxes/{sid}/sleep")
        assert r.status_code == 507 and r.json()["type"].endswith("/disk-full"), r.text
        assert "instance failed to sleep" in up.log.read_text()
        assert not (disk.path / "sandboxes" / sid / "snapshot.new").exists()
        disk.free()
        r = c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=30)
        assert r.status_code == 200 and r.json()["reply"] == "3: hi", r.text
        assert c.post(f"/v1/sandboxes/{sid}/sleep").json()["slept"] is True
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "4: hi"


def test_a_deploy_whose_builder_vm_memory_does_not_fit_the_disk_answers_507(vm_host: tuple[Up, SmallDisk]) -> None:
    """A deploy boots a builder VM whose RAM is a sparse file on the data disk: with 60 MiB free (room enough for the
    agent's own 8 MiB disk) its guest's memory filled the disk and QEMU died of SIGBUS, a 500 "sandbox-boot ...
    report trace id". It is the 507 disk-full answer, and the same deploy goes through once there is room."""
    up, disk = vm_host
    up.start()
    with up.client() as c:
        disk.leave(60 << 20)
        r = c.post("/v1/agents/echo/deployments", content=archive(disk_mib=8), headers=GZ, timeout=120)
        assert r.status_code == 507 and r.json()["type"].endswith("/disk-full"), r.text
        assert "memory did not fit" in r.json()["detail"], r.text
        disk.free()
        assert c.post("/v1/agents/echo/deployments", content=archive(disk_mib=8), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"


def test_a_checkpoint_that_finds_the_disk_full_answers_507_and_leaves_no_disk_snapshot_behind(
        vm_host: tuple[Up, SmallDisk]) -> None:
    """A checkpoint of a micro-VM on a full disk answered 500 "sandbox-qmp ... report trace id" (QEMU's device-state
    write says "An IO error has occurred"), and one that failed after its disk's internal snapshot was taken left
    that snapshot in disk.qcow2 for good: nothing lists it without its files, and it keeps the clusters it shares."""
    up, disk = vm_host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(disk_mib=64), headers=GZ).status_code == 201
        for n in (1, 2):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == f"{n}: hi"
        sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
        qcow2 = disk.path / "sandboxes" / sid / "disk.qcow2"

        def disk_snapshots() -> list[str]:
            out = subprocess.run(["qemu-img", "snapshot", "-l", "-U", str(qcow2)], capture_output=True, text=True)
            return [line.split()[1] for line in out.stdout.splitlines()[2:]]

        assert c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sync"]}).json()["exit_code"] == 0
        before = disk_snapshots()
        for room in (0, 256 << 10):  # no room for the device state; room for it, none for the memory pages
            disk.leave(room)
            r = c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": f"at-{room}"})
            disk.free()
            assert r.status_code == 507 and r.json()["type"].endswith("/disk-full"), (room, r.text)
            assert disk_snapshots() == before, room
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "3: hi"
        assert c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": "room"}).status_code == 201
