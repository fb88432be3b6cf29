"""A host SIGKILLed in the middle of a rollback or a fork: after a restart the instance is entirely at the old
point or entirely at the new one — its files and its store state agree."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moorage.store import EntityKey, Scope
from moorage.store.repos.checkpoints import Checkpoints
from tests.timetravel.crash_host import host

ROOT = Path(__file__).resolve().parents[2]


def _run(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.timetravel.crash_host", str(data), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


async def _state(data: Path) -> tuple[str, list[str]]:
    """After a restart (the host's recovery runs first): the files the agent sees and its facts' values."""
    async with host(data) as (rt, who):
        await rt.recover()
        files = (await rt.invoke(who, EntityKey("tt", "ada"), "ls")).reply
        ts = rt.store.tenant(who)
        facts = [f.value for f in ts.facts.list(Scope.for_user("tt", "ada"), statuses=("active", "pending"))]
        assert Checkpoints(ts).pending() == []  # nothing left half done
        return files, facts


DRIVERS = pytest.mark.parametrize("driver", ["process", "microvm"])


@DRIVERS
async def test_killed_mid_rollback_the_instance_ends_at_the_new_point(tmp_path: Path, driver: str) -> None:
    setup = _run(tmp_path, "setup", driver)
    assert setup.returncode == 0, setup.stderr[-2000:]
    ids = json.loads(setup.stdout.strip().splitlines()[-1])
    killed = _run(tmp_path, "rollback", ids["turn 2"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    files, facts = await _state(tmp_path)
    assert files == "1.txt,2.txt" and facts[-1] == "2"  # sandbox and store both at turn 2


@DRIVERS
async def test_killed_mid_fork_the_source_ends_at_the_old_point(tmp_path: Path, driver: str) -> None:
    setup = _run(tmp_path, "setup", driver)
    assert setup.returncode == 0, setup.stderr[-2000:]
    ids = json.loads(setup.stdout.strip().splitlines()[-1])
    killed = _run(tmp_path, "fork", ids["turn 2"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    files, facts = await _state(tmp_path)
    assert files == "1.txt,2.txt,3.txt,4.txt" and facts[-1] == "4"  # the source never left turn 4
