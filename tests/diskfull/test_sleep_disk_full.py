"""A sleep on a disk with little room, at every amount of room: the store's claim fits, then the sandbox's sleep or
the record of its outcome does not. The instance must serve its user's next turn once there is room. A sleep whose
failure could not be recorded (or whose success) left the instance ``suspending``: every turn of that user waited
for the claim to time out (two minutes), then for a sandbox that had been stopped half-way.

Which step meets the last free page depends on how much of SQLite's WAL is free to reuse at that moment, so a run
meets the window where the store is full after the sandbox's own sleep failed in about half the runs (it hung on
the old code when it did); the micro-VM's sleep (test_microvm_disk_full.py), whose snapshot is megabytes, meets the
window where only the sandbox's sleep fails every time."""

from __future__ import annotations

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def test_a_sleep_cut_short_by_a_full_disk_at_any_step_leaves_the_instance_serving_once_there_is_room(
        host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        n, outcomes = 0, []
        for room in range(0, 192 << 10, 4096):  # a page more room each time: each step of a sleep fails once
            n += 1
            r = c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=15)
            assert r.status_code == 200 and r.json()["reply"] == f"{n}: hi", (room, outcomes, r.text)
            sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
            disk.leave(room)
            r = c.post(f"/v1/sandboxes/{sid}/sleep")
            outcomes.append((room, r.status_code, r.json().get("slept")))
            disk.free()
        assert outcomes[-1][1:] == (200, True) and any(o[1] == 507 for o in outcomes), outcomes
        assert (200, False) not in [o[1:] for o in outcomes], outcomes  # a sleep the disk stopped says so: 507
        r = c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=15)
        assert r.json()["reply"] == f"{n + 1}: hi", r.text
