"""A process sandbox's checkpoint that does not fit the disk leaves nothing behind: its copy of the layer was made
under a hidden name and, when its record (``checkpoint.json``) found no room, was left there for good (no listing,
no start and no later checkpoint removes a hidden one), holding the space it took on a disk that was full."""

from __future__ import annotations

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def test_a_checkpoint_that_finds_the_disk_full_at_any_step_leaves_no_half_copy(host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
        sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
        checkpoints = disk.path / "sandboxes" / sid / "checkpoints"
        refused = 0
        for room in range(0, 128 << 10, 4096):  # a page more room each time: each step of a checkpoint fails once
            disk.leave(room)
            r = c.post(f"/v1/sandboxes/{sid}/checkpoint", json={})
            assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".")] == [], room
            if r.status_code != 507:
                break
            refused += 1
        assert r.status_code == 200 and refused >= 2, r.text
        disk.free()
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "2: hi"
