"""The guest's ``exec`` (``guest/ops_exec.py``) with a command that leaves a child in the background: it ends when
the command exits, the child holding its output or not (Python 3.11's ``Process.wait()`` waited for the child to
close the pipes: the exec ran to its timeout, reported as timed out); and cancelled in the loop step the command's
exit is seen, the cancel holds and kills the process group, the child included (3.11's ``wait_for`` dropped the
cancel: the exec answered as if it had not been cancelled, and the child ran on)."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from asyncio.base_subprocess import BaseSubprocessTransport
from pathlib import Path
from typing import Any

import pytest

from moorage.guest.ops_exec import ExecService


class _Ctx:
    def __init__(self) -> None:
        self.out: list[tuple[str, bytes]] = []

    async def emit(self, event: str, data: Any = None) -> None:
        self.out.append((event, base64.b64decode(data)))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_an_exec_cancelled_as_its_command_exits_is_cancelled_and_kills_its_background_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running: list[asyncio.Task[Any]] = []
    exited = BaseSubprocessTransport._process_exited  # where the exec learns that its command exited

    def exited_and_cancelled(self: BaseSubprocessTransport, returncode: int) -> None:
        exited(self, returncode)
        for task in running:  # the host's $cancel lands in the step the command's exit is seen
            task.cancel()

    monkeypatch.setattr(BaseSubprocessTransport, "_process_exited", exited_and_cancelled)
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


async def test_a_command_that_leaves_a_child_holding_its_output_ends_when_it_exits(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    ctx = _Ctx()
    started = time.monotonic()
    try:
        out = await ExecService(dict(os.environ), str(tmp_path)).exec(  # type: ignore[arg-type]
            {"argv": ["sh", "-c", f"echo started; sleep 60 & echo $! > {pidfile}; exit 3"], "timeout": 10}, ctx)
        took = time.monotonic() - started
        assert out == {"exit_code": 3, "timed_out": False} and took < 5, (out, took)
        assert ctx.out == [("stdout", b"started\n")]
        assert _alive(int(pidfile.read_text()))  # a child the command left running is not the exec's to end
    finally:
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)
