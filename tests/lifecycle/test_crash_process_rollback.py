"""A process sandbox's rollback of a sleeping sandbox swaps in a copy of the checkpoint's layer by two renames (the
layer aside, the copy in): a host SIGKILLed between them left no layer at all, and the next boot removed both
hidden directories, the sandbox's files with them. The next boot now finishes the swap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from moorage.config import Config
from moorage.sandbox.process import ProcessDriver

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
