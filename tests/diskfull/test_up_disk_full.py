"""`moorage up` started again while its data directory's disk is full: it says so in one line and exits 2 (it died
with a 160-line traceback of the record it could not write), and starts once there is room, nothing lost."""

from __future__ import annotations

import subprocess
import sys

from tests.diskfull.conftest import GZ, SmallDisk, archive
from tests.lifecycle.crash_up import ROOT, Up


def test_moorage_up_on_a_full_disk_says_so_in_one_line_and_starts_once_there_is_room(
        host: tuple[Up, SmallDisk]) -> None:
    up, disk = host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "1: hi"
    disk.fill()
    up.stop()  # ada's sandbox could not be put to sleep: the next start has to write its record
    r = subprocess.run([sys.executable, "-m", "tests.lifecycle.crash_up"], env=up.env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error: the disk is out of space" in r.stderr and "free space on that disk" in r.stderr, r.stderr
    disk.free()
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "2: hi"
