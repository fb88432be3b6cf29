"""How the guest learns that a child it started has exited: a pidfd in the event loop, no thread per child.

Python 3.11's asyncio watches every child it starts (``exec``, an agent's own ``create_subprocess_exec``) with a
new thread (``ThreadedChildWatcher``). A thread is a task to the kernel: in a sandbox whose pids limit is full (a
fork bomb that the agent started a moment before) the watcher cannot start, and the ``exec`` that started the
child fails with "can't start new thread" although the child runs. A pidfd needs no task: the loop that started
the child reads it. Python 3.12 makes that its default; this is the same idea for the guest's 3.11, installed
once as the supervisor starts. A process the agent leaves running (``ctx.spawn``) is reaped the same way.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Tuple


class PidfdChildWatcher(asyncio.AbstractChildWatcher):
    """Each child is waited for by the loop that started it (an agent's own loop in a worker thread included)."""

    def __init__(self) -> None:
        self._waiting: Dict[int, Tuple[asyncio.AbstractEventLoop, int]] = {}

    def add_child_handler(self, pid: int, callback: Callable[..., Any], *args: Any) -> None:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
        self._waiting[pid] = (loop, pidfd)
        loop.add_reader(pidfd, self._exited, pid, callback, args)

    def _exited(self, pid: int, callback: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        loop, pidfd = self._waiting.pop(pid)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            # Reaped by someone else (an agent's own os.wait()): what it exited with is theirs, as asyncio says.
            returncode = 255
        callback(pid, returncode, *args)

    def remove_child_handler(self, pid: int) -> bool:
        entry = self._waiting.pop(pid, None)
        if entry is None:
            return False
        loop, pidfd = entry
        loop.remove_reader(pidfd)
        os.close(pidfd)
        return True

    def attach_loop(self, loop: Any) -> None:
        pass  # each child belongs to the loop that started it

    def is_active(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> "PidfdChildWatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def install() -> bool:
    """Use :class:`PidfdChildWatcher` for this process's asyncio children where Python does not already.

    False where Python is 3.12 or later (its default is a pidfd already) or the kernel has no pidfd (before 5.3).
    """
    if sys.version_info >= (3, 12):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_child_watcher(PidfdChildWatcher())
    return True


def reap(proc: "subprocess.Popen[bytes]") -> None:
    """Reap ``proc``, a child this process started and left running, once it exits (no zombie is left, which would
    look alive in /proc to the agent's own checks): on a pidfd the running loop watches when that is the main
    thread's loop (the supervisor's, which lives as long as the process), else with a thread."""
    try:
        loop = asyncio.get_running_loop() if threading.current_thread() is threading.main_thread() else None
        pidfd = os.pidfd_open(proc.pid) if loop is not None else -1
    except (AttributeError, OSError, RuntimeError):
        loop, pidfd = None, -1
    if loop is None or pidfd < 0:
        threading.Thread(target=proc.wait, daemon=True, name="moorage-spawned-%d" % proc.pid).start()
        return

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        proc.poll()  # it exited, and its pid stays its own until reaped: here, by the object that knows it

    loop.add_reader(pidfd, exited)
