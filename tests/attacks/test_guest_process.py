"""Attacks on the shared host kernel and filesystem from a hostile agent in a process sandbox.

The process driver runs guests on the host's kernel, so what matters is what the kernel lets them reach: no
nested user namespaces (bubblewrap --disable-userns plus the seccomp filter), no raw or packet sockets, no host
paths, and a disk quota that holds even when the writer is the supervisor process itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio

from moorage.errors import MoorageError
from moorage.sandbox.process_fs import disk_usage
from tests.attacks.conftest import Hostile, MiB, hostile_env

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hostile(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hostile]:
    async for h in hostile_env(tmp_path_factory.mktemp("attack-process"), "process"):
        yield h


async def test_user_namespaces_cannot_be_created(hostile: Hostile) -> None:
    got = json.loads(await hostile.say("userns"))
    assert got == {"user": "EPERM", "net": "EPERM", "mount": "EPERM"}, got


async def test_raw_and_packet_sockets_are_refused(hostile: Hostile) -> None:
    got = json.loads(await hostile.say("raw-socket"))
    assert got["raw-icmp"] == "EPERM" and got["packet"] == "EAFNOSUPPORT", got
    assert got["interfaces"] == ["lo"], got


async def test_host_paths_are_not_reachable(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    bystander = await hostile.sandbox(hostile.bystander)
    data_dir = hostile.env.cfg.data_dir
    probes = ["/etc/shadow", "/root", "/home", "/var/lib", "/proc/1/environ", "/sys/fs/cgroup/memory",
              str(data_dir), str(data_dir / "store"), str(sb.dir / "meta.json"), str(bystander.dir),
              str(bystander.layer / "work"), str(Path.cwd() / "pyproject.toml"), "/run/moorage/../../etc/shadow"]
    found = json.loads(await hostile.say("host-paths " + json.dumps(probes)))
    # /proc/1 inside the sandbox is the sandbox's own init (its own pid namespace), not the host's.
    assert [p for p in found if p != "/proc/1/environ"] == [], found
    assert await hostile.say("ping", hostile.bystander) == "pong"


async def test_disk_filled_by_the_supervisor_itself_stops_the_sandbox(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    quota = sb.spec.disk_mib * MiB
    with await hostile.measured() as rss:
        with pytest.raises(MoorageError):
            await hostile.say("fill-disk")  # writes in-process: no worker for the watchdog to kill
    assert rss.growth < 64 * MiB, rss.growth
    # The turn fails as the stop kills the supervisor, and the sandbox is stopped from then on, while its kill may
    # still run: the very next turn (below, without waiting) restarts it after the kill, never runs on it.
    assert sb.quota_exceeded and sb.state.value == "stopped"
    # Bounded by the quota plus what one poll interval lets through, never by the host's free space.
    assert disk_usage(sb.layer) < quota + 512 * MiB
    # Stopped cleanly: it comes back, can clean up, and works.
    assert await hostile.say("clean-disk") == "cleaned"
    assert await hostile.say("ping") == "pong"
    assert await hostile.say("ping", hostile.bystander) == "pong"
