"""Attacks on the host from a hostile agent's code, on both sandbox drivers: through the channel, the console,
the filesystem, and against the process that confines the guest (bubblewrap or QEMU).

Each attack is contained: the host's resident memory stays under the stated bound while it runs, the host keeps
serving the bystander instance, and the attacker is still usable afterwards (or was stopped cleanly and comes
back on its next turn). One runtime per driver serves the whole module (booting guests is the slow part).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio

from moorage.errors import MoorageError
from moorage.sandbox.base import GuestFileTooLarge, READ_FILE_MAX_BYTES
from moorage.sandbox.capped_log import DEFAULT_CAP_BYTES
from moorage.sandbox.channel import MAX_GUEST_INFLIGHT
from tests.attacks.conftest import Hostile, MiB, hostile_env

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["process", "microvm"])
async def hostile(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hostile]:
    async for h in hostile_env(tmp_path_factory.mktemp(f"attack-{request.param}"), request.param):
        yield h


async def still_fine(h: Hostile) -> None:
    assert await h.say("ping", h.bystander) == "pong"
    assert await h.say("ping") == "pong"


async def test_request_flood_is_capped_per_channel(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    # A small flood first: the host's worker threads and their store connections start once, whatever the load.
    assert await hostile.say("flood 500") == "flooded 500"
    with await hostile.measured() as rss:
        reply = await hostile.say("flood 20000")
    assert reply == "flooded 20000"
    assert rss.growth < 32 * MiB, rss.growth
    # Past the cap the host answered "busy" inline instead of starting a task per request.
    assert sb.channel.busy_rejects > 0
    assert sb.channel.max_guest_inflight == MAX_GUEST_INFLIGHT
    await still_fine(hostile)


async def test_an_honest_burst_past_the_cap_is_served_in_turn(hostile: Hostile) -> None:
    # Four times the cap, started at once: past the cap the host answers busy and the guest runtime retries
    # (how many depends on how fast the guest sends), so every call is served and none fails.
    assert await hostile.say(f"burst {MAX_GUEST_INFLIGHT * 4}") == f"served {MAX_GUEST_INFLIGHT * 4}"


async def test_deeply_nested_frames_are_refused_and_the_turn_goes_on(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    before = sb.channel.rejected_frames
    with await hostile.measured() as rss:
        assert await hostile.say("deep 200000") == "survived"
    assert sb.channel.rejected_frames >= before + 2
    assert rss.growth < 64 * MiB, rss.growth
    await still_fine(hostile)


async def test_event_flood_is_bounded(hostile: Hostile) -> None:
    with await hostile.measured() as rss:
        reply = await hostile.say("events 20000")  # 80 MB of events, streamed to nobody
    assert reply == "emitted 20000"
    assert rss.growth < 64 * MiB, rss.growth
    await still_fine(hostile)


async def test_file_read_that_never_ends_is_cut_off(hostile: Hostile) -> None:
    assert await hostile.say("endless-read") == "armed"
    sb = await hostile.sandbox()
    with await hostile.measured() as rss:
        with pytest.raises(GuestFileTooLarge) as e:
            await sb.read_file("/work/anything")
    assert str(READ_FILE_MAX_BYTES) in str(e.value) and e.value.hint
    assert rss.growth < 3 * READ_FILE_MAX_BYTES, rss.growth  # the capped buffer, never more
    with pytest.raises(GuestFileTooLarge):
        await sb.read_file("/work/anything", max_bytes=4 * MiB)
    await still_fine(hostile)


async def test_console_flood_is_capped_on_disk(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    name = "console.log" if hostile.driver == "microvm" else "supervisor.log"
    amount = 3 * DEFAULT_CAP_BYTES  # past the cap and its rotation: NAME and NAME.1 both full, the rest dropped
    assert (await hostile.say(f"console {amount}")).startswith("wrote")
    log, rotated = sb.dir / name, sb.dir / f"{name}.1"
    on_disk = sum(p.stat().st_size for p in (log, rotated) if p.exists())
    assert rotated.exists() and on_disk <= 2 * DEFAULT_CAP_BYTES, on_disk
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    await still_fine(hostile)


async def test_huge_frame_stops_the_attacker_cleanly_and_it_comes_back(hostile: Hostile) -> None:
    with await hostile.measured() as rss:
        with pytest.raises(MoorageError):
            await hostile.say("huge")
    assert rss.growth < 64 * MiB, rss.growth  # the announced 4 GiB were never read or allocated
    sb = await hostile.sandbox()
    assert sb.state.value == "stopped"
    await still_fine(hostile)  # the next turn starts the attacker afresh
    assert json.loads(await hostile.say('host-paths ["/work"]')) == ["/work"]


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


async def test_the_confining_process_is_confined_itself(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    root = os.geteuid() == 0
    if hostile.driver == "microvm":
        st = _status(sb.pid)
        # QEMU: its own seccomp filter, no capability, no way back to privileges.
        assert st["Seccomp"].strip() == "2" and st["NoNewPrivs"].strip() == "1", st
        if root:
            assert int(st["CapEff"], 16) == 0 and int(st["CapBnd"], 16) == 0, st
            # ...and not root: its sandbox's own uid and gid (real, effective, saved, filesystem).
            assert "0" not in st["Uid"].split() + st["Gid"].split(), st
        run = sb.run_dir
        assert run.parent == sb.dir and oct(run.stat().st_mode & 0o777) == "0o700"
        assert {p.name for p in run.iterdir()} >= {"qmp.sock", "chan.sock"}
    else:
        from moorage.sandbox import process_limits

        supervisor = [p for p in process_limits.descendants(sb._pid) if b"/opt/moorage/guest" in
                      Path(f"/proc/{p}/cmdline").read_bytes()]
        assert supervisor
        st = _status(supervisor[0])
        assert st["Seccomp"].strip() == "2" and st["NoNewPrivs"].strip() == "1" and int(st["CapEff"], 16) == 0, st
        if root:
            assert st["Uid"].split()[0] == str(hostile.env.cfg.sandbox_uid)
    # Nothing of a sandbox is readable by other local users.
    assert oct(sb.dir.parent.stat().st_mode & 0o777) == "0o700"


async def test_host_paths_and_networks_are_out_of_reach(hostile: Hostile) -> None:
    sb = await hostile.sandbox()
    bystander = await hostile.sandbox(hostile.bystander)
    data_dir = hostile.env.cfg.data_dir
    probes = ["/etc/shadow-host-canary", str(data_dir), str(data_dir / "store"), str(sb.dir), str(bystander.dir),
              str(Path.cwd() / "pyproject.toml"), str(Path.home() / ".bash_history")]
    assert json.loads(await hostile.say("host-paths " + json.dumps(probes))) == []
    net = json.loads(await hostile.say("raw-socket"))
    assert net["interfaces"] == ["lo"], net  # whatever sockets it may open, there is no network to use them on
    await still_fine(hostile)


async def test_a_run_directory_someone_else_made_is_refused(tmp_path: Path) -> None:
    """A local user who creates a sandbox's run directory first could pose as its guest or monitor: refused."""
    from moorage.sandbox.base import SandboxError
    from moorage.sandbox.microvm_qemu import ensure_private_dir

    mine = ensure_private_dir(tmp_path / "fresh")
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    assert ensure_private_dir(mine) == mine  # ours, 0700: reused
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(SandboxError) as e:
        ensure_private_dir(open_dir)
    assert "mode 777" in str(e.value) and e.value.hint
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(SandboxError):
        ensure_private_dir(link)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 64001, 64001)
        with pytest.raises(SandboxError) as e:
            ensure_private_dir(theirs)
        assert "owned by uid 64001" in str(e.value)
