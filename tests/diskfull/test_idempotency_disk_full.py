"""A request with an ``Idempotency-Key`` that the disk fills under, at every amount of room: its key is claimed, then
the work or the keeping of its answer finds no room. Once there is room, a retry with the same key runs it (the work
was not done) or replays its answer (it was). The claim stayed when it could not be dropped or completed either, and
every retry with the key was a 409 "still in progress" until the host restarted."""

from __future__ import annotations

import time

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def test_a_key_claimed_before_the_disk_filled_is_run_or_replayed_once_there_is_room(host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
        kept_later = 0
        for room in range(0, 96 << 10, 4096):  # a page more room each time: each write fails once
            key = {"Idempotency-Key": f"checkpoint-{room}"}
            disk.leave(room)
            first = c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": f"at-{room}"}, headers=key)
            disk.free()
            deadline = time.monotonic() + 5
            while (again := c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": f"at-{room}"},
                                   headers=key)).status_code == 409 and time.monotonic() < deadline:
                time.sleep(0.2)  # settled within a second of there being room
            assert again.status_code == 201, (room, first.text, again.text)
            if first.status_code == 507 and "answer could not be kept" in first.json()["detail"]:
                assert again.headers.get("Idempotent-Replayed") == "true", room  # done once, not twice
                kept_later += 1
        # Whether some amount of room lets the work fit and not its answer depends on the store's file layout
        # (SQLite's log reuses the space it already has: since store migration 29 no such room is met here); that
        # window is pinned by tests/api/test_idempotency_answer_not_kept.py, the disk made full at the answer's write.
        print(f"\nanswers kept once there was room: {kept_later}")
        names = [ck["name"] for ck in c.get("/v1/agents/echo/users/ada/checkpoints?limit=200").json()["data"]]
        ours = [n for n in names if n and n.startswith("at-")]
        assert len(ours) == len(set(ours)) and len(ours) >= 20, names  # each made once
