"""A turn whose last write (its reply and the run's end) does not fit the disk: its caller gets 507, and the run is
recorded failed as soon as there is room. It stayed ``running``: an async turn read ``running`` until the host
restarted, and the restart then ran the agent's turn again although it had been reported failed."""

from __future__ import annotations

import time

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import Up


def test_an_async_turn_cut_short_by_a_full_disk_ends_failed_once_there_is_room_and_is_not_run_again(
        host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
        r = c.post("/v1/agents/echo/invoke?async=true", json={"message": "fill 0 after 1", "user": "ada"})
        assert r.status_code == 202, r.text
        eid = r.json()["id"]
        deadline = time.monotonic() + 10
        while c.get(f"/v1/executions/{eid}").json()["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        disk.fill()  # while the agent waits: the turn's end finds the disk full
        time.sleep(2)
        disk.free()
        deadline = time.monotonic() + 10
        while (ex := c.get(f"/v1/executions/{eid}").json())["status"] == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ex["status"] == "failed" and "out of disk space" in (ex["error"] or ""), ex
    up.stop()
    up.start()
    with up.client() as c:
        ex = c.get(f"/v1/executions/{eid}").json()
        assert ex["status"] == "failed" and ex["reply"] is None, ex  # not run again by the restart
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "2: hi"
