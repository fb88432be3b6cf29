"""How a micro-VM's supervisor ended, read from the guest init's console line (sandbox/microvm_guest_port.py): the
line of this supervisor's end, never an earlier one's, whether it was written before the host heard the port
close or after, in a forked VM's console (no start line) and in one rotated meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorage.sandbox.microvm_guest_port import ConsoleTail, Ended

SERVING = '{"event": "serving virtio port", "device": "/dev/vport1p1"}\n'


def exited(status: int, oom_kills: int | None = 0) -> str:
    if oom_kills is None:  # an init of guest code before 2026-12 (still on older VMs' disks)
        return f"moorage-init: supervisor exited ({status}); restarting\n"
    return f"moorage-init: supervisor exited ({status}; oom_kill +{oom_kills}); restarting\n"


def ended(log: Path, before: str, after: str = "") -> Ended | None:
    log.write_text(before)
    tail = ConsoleTail(log)  # made as the port's close is heard
    if after:
        with open(log, "a") as f:
            f.write(after)
    return asyncio.run(tail.exit_status())


def status_of(log: Path, before: str, after: str = "") -> int | None:
    found = ended(log, before, after)
    return None if found is None else found.status


def test_the_line_written_before_the_close_was_heard_is_this_supervisors(tmp_path: Path) -> None:
    assert status_of(tmp_path / "console.log", SERVING + exited(3) + SERVING + exited(1)) == 1


def test_a_line_written_after_the_close_is_taken(tmp_path: Path) -> None:
    assert status_of(tmp_path / "console.log", SERVING + exited(3) + SERVING, exited(137)) == 137


def test_an_earlier_supervisors_end_is_never_taken_for_this_one(tmp_path: Path) -> None:
    # The supervisor now ending started after that line: its own end not yet written, nothing is known (the host
    # then waits for the next supervisor's answer, as before).
    log = tmp_path / "console.log"
    log.write_text(exited(3) + SERVING)
    assert ConsoleTail(log)._read() is None


def test_a_forked_vms_console_has_no_start_line_and_its_first_end_is_read(tmp_path: Path) -> None:
    assert status_of(tmp_path / "console.log", '{"event": "extension loaded"}\n' + exited(5)) == 5


def test_a_console_rotated_after_the_close_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_text(SERVING * 50)
    tail = ConsoleTail(log)
    log.rename(tmp_path / "console.log.1")
    log.write_text(exited(9))
    assert asyncio.run(tail.exit_status()) == Ended(9, 0)


def test_a_kill_for_memory_is_told_by_the_line_itself(tmp_path: Path) -> None:
    assert ended(tmp_path / "console.log", SERVING, exited(137, 1)) == Ended(137, 1)
    assert ended(tmp_path / "console.log", SERVING, exited(137, 0)) == Ended(137, 0)  # a kill from inside


def test_an_older_inits_line_says_only_the_status(tmp_path: Path) -> None:
    # A VM whose disk has the init from before the count: a kill then waits for the next supervisor's word.
    assert ended(tmp_path / "console.log", SERVING + exited(137, None)) == Ended(137, None)
    assert ended(tmp_path / "console.log", SERVING + exited(3, None)) == Ended(3, None)
