"""A process sandbox's rollback of a sleeping sandbox swaps in a copy of the checkpoint's layer by two renames (the
layer aside, the copy in): a host SIGKILLed between them left no layer at all, and the next boot removed both
hidden directories, the sandbox's files with them. The next boot now finishes the swap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.sandbox.process import ProcessDriver
from tests.lifecycle.crash_up import Up, stop_sandboxes
from tests.lifecycle.test_crash_operations import GZ, _archive, _in_background

KILLED_IN_A_ROLLBACK = """
import asyncio, os, signal, sys
from pathlib import Path
from moorage.config import Config
from moorage.sandbox.process import ProcessDriver

async def main(data):
    d = ProcessDriver(data / "sandboxes", Config(data_dir=data))
    sb = await d.create("sb1")
    await sb.start()
    await sb.write_file("/work/a.txt", b"one")
    await sb.checkpoint("c1")
    await sb.write_file("/work/a.txt", b"two")
    await sb.sleep()  # a rollback of a sandbox not running swaps the layer by renames
    real = os.rename
    def rename(a, b):
        if ".layer-rollback-" in str(a):  # the copy renamed in: the layer is already aside
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
    os.rename = rename
    await sb.rollback("c1")

asyncio.run(main(Path(sys.argv[1])))
"""


async def test_killed_between_a_rollbacks_renames_the_next_boot_finishes_it(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED_IN_A_ROLLBACK, str(tmp_path)],
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    sbdir = tmp_path / "sandboxes" / "sb1"
    assert not (sbdir / "layer").exists()
    assert sorted(p.name[:-8] for p in sbdir.iterdir() if p.name.startswith(".layer-")) == [".layer-old-",
                                                                                           ".layer-rollback-"]

    d = ProcessDriver(tmp_path / "sandboxes", Config(data_dir=tmp_path))
    try:
        sb = await d.open("sb1")
        await sb.wake()
        assert await sb.read_file("/work/a.txt") == b"one"  # at the checkpoint, as the rollback meant
        await sb.rollback("c1")  # and it rolls back again
        assert await sb.read_file("/work/a.txt") == b"one"
        await sb.destroy()
    finally:
        await d.close()


FILES_AGENT = '''
import json

async def on_message(ctx, message):
    if message != "ls":
        ctx.files.write(f"notes/{message}.txt", message)
    return json.dumps(sorted(ctx.files.list("notes")))
'''


def test_killed_inside_a_rollback_in_place_the_next_start_finishes_it(tmp_path: Path) -> None:
    """A running process sandbox rolls back in place: each entry of its layer is moved to the trash, then the
    checkpoint's copy of it in. A host SIGKILLed between the two renames left the layer without that entry (here
    /work/.moorage, the agent's code); the rollback's recorded intent runs again at the next start, and the instance is at the
    checkpoint, its files all there."""
    up = Up(tmp_path / "data", free_port(), "process")
    try:
        # Armed from the start: the zygote that restarts an agent in place is its host's (a new host restarts the
        # sandbox instead). The first rename into the rollback's trash, once it is done.
        up.start("os:rename", after=True, crash_if=".layer-old-")
        with up.client() as c:
            archive = _archive("pf", FILES_AGENT, '[agent.timetravel]\nauto = true\n[agent.lifecycle]\nusers = "auto"\n')
            assert c.post("/v1/agents/pf/deployments", content=archive, headers=GZ).status_code == 201
            for m in ("m1", "m2", "m3"):
                r = c.post("/v1/agents/pf/invoke", json={"message": m, "user": "ada"})
                assert r.status_code == 200, r.text
            data = c.get("/v1/agents/pf/users/ada/checkpoints", params={"limit": 500}).json()["data"]
            one = next(ck["id"] for ck in data if (ck.get("summary") or {}).get("turn", {}).get("message") == "m1")
            _in_background(lambda: c.post(f"/v1/agents/pf/users/ada/checkpoints/{one}/rollback"))
            assert up.died()
        sb = next(p for p in (up.data / "sandboxes").iterdir() if (p / "layer" / "work").is_dir()
                  and any(d.name.startswith(".layer-old-") for d in p.iterdir()))
        trash = next(d for d in sb.iterdir() if d.name.startswith(".layer-old-"))
        moved = [p.name for p in (trash / "work").iterdir()]  # the agent's code (/work/.moorage) comes first
        assert moved and not any((sb / "layer" / "work" / name).exists() for name in moved)  # the entry is gone

        up.start()
        with up.client() as c:
            r = c.post("/v1/agents/pf/invoke", json={"message": "ls", "user": "ada"})
            assert r.status_code == 200, r.text
            assert json.loads(r.json()["reply"]) == ["m1.txt"]  # at the checkpoint, as the rollback meant
            r = c.post("/v1/agents/pf/invoke", json={"message": "m4", "user": "ada"})
            assert json.loads(r.json()["reply"]) == ["m1.txt", "m4.txt"]
        assert "finishing an interrupted time-travel operation" in up.log.read_text()  # by its recorded intent
        deadline = time.monotonic() + 30  # what the killed rollback staged is removed (in the background)
        while any(d.name.startswith(".layer-") for d in sb.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(d.name.startswith(".layer-") for d in sb.iterdir())
    finally:
        up.stop()
        stop_sandboxes(up.data)
