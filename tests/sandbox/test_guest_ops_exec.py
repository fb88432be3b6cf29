"""The guest's ``exec`` (``guest/ops_exec.py``) cancelled in the loop step its command's end is seen: the cancel
holds and kills the command's process group, a child it left in the background included. With Python 3.11's
``wait_for`` the cancel was dropped: the exec answered as if it had not been cancelled, and the child ran on."""

from __future__ import annotations

import asyncio
import os
import time
from asyncio.base_subprocess import BaseSubprocessTransport
from pathlib import Path
from typing import Any

import pytest

from moorage.guest.ops_exec import ExecService


class _Ctx:
    async def emit(self, event: str, data: Any = None) -> None:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_an_exec_cancelled_as_its_command_exits_is_cancelled_and_kills_its_background_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running: list[asyncio.Task[Any]] = []
    # Where 3.11 wakes ``Process.wait()``: the command exited and its pipes are closed.
    ended = BaseSubprocessTransport._call_connection_lost

    def ended_and_cancelled(self: BaseSubprocessTransport, exc: BaseException | None) -> None:
        ended(self, exc)
        for task in running:  # the host's $cancel lands in the step the command's end is seen
            task.cancel()

    monkeypatch.setattr(BaseSubprocessTransport, "_call_connection_lost", ended_and_cancelled)
    pidfile = tmp_path / "child.pid"
    service = ExecService(dict(os.environ), str(tmp_path))
    # The command exits once the exec waits for it (an exit during the spawn is another case), its child running on
    # without its pipes.
    task = asyncio.ensure_future(service.exec(  # type: ignore[arg-type]
        {"argv": ["sh", "-c", f"sleep 60 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}; sleep 0.3"], "timeout": 60}, _Ctx()))
    running.append(task)
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
        child = int(pidfile.read_text())
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(child), "the cancelled exec left its background child running"
    finally:
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)
