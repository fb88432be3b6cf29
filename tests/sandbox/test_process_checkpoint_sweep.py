"""The sweep of half-made process checkpoints removes a hidden copy only once its maker is gone: one that another
live process is making now (it holds the copy's lock) stays, and goes once that process is SIGKILLed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from moorage.sandbox import process_checkpoints
from moorage.sandbox.process_checkpoints import MAKING, UNLOCKED_STALE_S, sweep_unfinished

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_copy_being_made_stays_and_goes_once_its_maker_is_killed(tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints" / ".before-upgrade.1a2b3c4d"
    (copy / "layer").mkdir(parents=True)
    done = tmp_path / "checkpoints" / "whole"
    (done / "layer").mkdir(parents=True)
    maker = subprocess.Popen([sys.executable, "-c", HOLD, str(copy / MAKING)], stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None and maker.stdout.readline().strip() == "held"
        assert sweep_unfinished(tmp_path) == [] and copy.is_dir()
    finally:
        maker.kill()
        maker.wait(10)
    assert sweep_unfinished(tmp_path) == [copy] and not copy.exists()
    assert done.is_dir()  # a checkpoint's own directory is never touched


def test_a_copy_without_its_lock_file_goes_only_once_it_is_old(tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints" / ".x.00000000"
    (copy / "layer").mkdir(parents=True)
    assert sweep_unfinished(tmp_path) == [] and copy.is_dir()  # its maker may be between mkdir and the lock
    old = time.time() - UNLOCKED_STALE_S - 1
    os.utime(copy, (old, old))
    assert sweep_unfinished(tmp_path) == [copy]


def test_a_taken_checkpoint_keeps_no_lock_file(tmp_path: Path) -> None:
    (tmp_path / "layer").mkdir()
    (tmp_path / "layer" / "f").write_text("x")
    info = process_checkpoints.take(tmp_path, "sb", "one")
    assert (info.path / "checkpoint.json").exists() and not (info.path / MAKING).exists()
    assert sweep_unfinished(tmp_path) == []
