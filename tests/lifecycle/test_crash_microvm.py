"""A micro-VM whose host was SIGKILLed: what the restarted host does to the VM it finds still running (its QEMU is no
child of the new host)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


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
