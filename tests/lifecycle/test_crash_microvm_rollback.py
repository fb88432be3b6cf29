"""`moorage up` on the micro-VM driver SIGKILLed in the middle of a rollback (tests/lifecycle/crash_up.py kills it at
a chosen call), then started again: the instance is entirely at the old point or entirely at the rolled-back one
(its files, its agent process's memory and its store rows agree), nothing the rollback staged is left that no record
names, the disk's snapshots are those its checkpoints name, and its turns and rollbacks go on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.lifecycle.crash_up import Up
from tests.lifecycle.test_crash_microvm import _disk_snapshots, _instance, _named, up  # noqa: F401 - fixture
from tests.lifecycle.test_crash_operations import GZ, _archive, _in_background

AGENT = '''
import json

COUNT = 0  # lives in the guest's agent process: only a memory snapshot keeps it

async def on_message(ctx, message):
    global COUNT
    if message == "ls":
        return json.dumps({"files": sorted(ctx.files.list("notes")), "count": COUNT})
    COUNT += 1
    ctx.files.write(f"notes/{COUNT}.txt", message)
    await ctx.memory.learn("user", "count", str(COUNT), f"count is {COUNT}")
    return f"count={COUNT}"
'''


def _say(c: httpx.Client, message: str) -> str:
    r = c.post("/v1/agents/vm/invoke", json={"message": message, "user": "ada"})
    assert r.status_code == 200, r.text
    return str(r.json()["reply"])


def _where(up: Up, c: httpx.Client) -> dict[str, Any]:
    """The files and the agent process's counter, as the agent sees them, and the store's count facts."""
    from moorage.config import Config
    from moorage.store import Scope, open_store

    seen: dict[str, Any] = json.loads(_say(c, "ls"))
    c.get("/v1/agents/vm/users/ada/checkpoints")  # once the turn's checkpoint is written (behind the turn)
    store = open_store(Config(data_dir=up.data))
    try:
        seen["facts"] = sorted(f.value for ts in store.operator.tenants()
                         for f in ts.facts.list(Scope.for_user("vm", "ada"), statuses=("active", "pending"))
                         if f.attribute == "count")
    finally:
        store.close()
    return seen


def _at(n: int) -> dict[str, Any]:
    return {"files": [f"{i}.txt" for i in range(1, n + 1)], "count": n, "facts": [str(i) for i in range(1, n + 1)]}


def _staged_or_half(sb: Path) -> list[Path]:
    """What a snapshot, a checkpoint or a rollback leaves while it is made or swapped in."""
    names = ("snapshot.rollback", "snapshot.new", "snapshot.old")
    return [*(p for p in (sb / n for n in names) if p.exists()),
            *(sb / "checkpoints").glob("*.new"), *(sb / "checkpoints").glob("*.old")]


def _checkpoint_of(c: httpx.Client, message: str) -> str:
    data = c.get("/v1/agents/vm/users/ada/checkpoints", params={"limit": 500}).json()["data"]
    return next(ck["id"] for ck in data if (ck.get("summary") or {}).get("turn", {}).get("message") == message)


def test_killed_in_a_rollback_the_instance_is_at_one_point_and_nothing_staged_is_left(up: Up) -> None:
    archive = _archive("vm", AGENT, '[agent.timetravel]\nauto = true\n[agent.lifecycle]\nusers = "auto"\n')
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/vm/deployments", content=archive, headers=GZ).status_code == 201
        assert [_say(c, f"m{i}") for i in range(1, 5)] == ["count=1", "count=2", "count=3", "count=4"]
        two, one = _checkpoint_of(c, "m2"), _checkpoint_of(c, "m1")
    up.stop()  # the instance runs on past its host
    sb = _instance(up)

    # Killed once the disk is back at checkpoint m2 and its memory staged (snapshot.rollback), the VM gone, the
    # staged memory not yet in place and the store not rolled back.
    up.start("moorage.sandbox.microvm_snapshots:revert_disk", after=True)
    with up.client() as c:
        _in_background(lambda: c.post(f"/v1/agents/vm/users/ada/checkpoints/{two}/rollback"))
        assert up.died()
    assert (sb / "snapshot.rollback" / "dev.state").exists()

    up.start()
    with up.client() as c:
        assert _where(up, c) == _at(2)  # entirely at the rolled-back point
        assert _staged_or_half(sb) == []
        assert _disk_snapshots(sb) == _named(sb)

        # Killed while the memory of checkpoint m1 is staged, the guest still running at m2.
        up.stop()
    up.start("moorage.sandbox.microvm_ram_chain:materialize", after=True)
    with up.client() as c:
        _in_background(lambda: c.post(f"/v1/agents/vm/users/ada/checkpoints/{one}/rollback"))
        assert up.died()
    assert (sb / "snapshot.rollback" / "ram.delta").exists()

    up.start()
    with up.client() as c:
        assert _where(up, c) == _at(1)
        assert _staged_or_half(sb) == []
        assert _disk_snapshots(sb) == _named(sb)
        assert _say(c, "again") == "count=2"  # the next turn
        r = c.post(f"/v1/agents/vm/users/ada/checkpoints/{two}/rollback")  # and a second rollback
        assert r.status_code == 200, r.text
        assert _where(up, c) == _at(2)
        assert _say(c, "on") == "count=3"
        c.get("/v1/agents/vm/users/ada/checkpoints")  # its checkpoint written
        assert _staged_or_half(sb) == []
        assert _disk_snapshots(sb) == _named(sb)


def test_killed_in_a_fork_the_source_is_back_and_its_way_back_is_not_left(up: Up) -> None:
    """A fork takes the source to the checkpoint, makes a template of it and returns it through a temporary sandbox
    checkpoint (``tt-fork-*``, named by no checkpoint row); a host killed while the template is made returns the
    source at its next start, and that temporary checkpoint goes then too (it was kept, files and disk snapshot)."""
    archive = _archive("vm", AGENT, '[agent.timetravel]\nauto = true\n[agent.lifecycle]\nusers = "auto"\n')
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/vm/deployments", content=archive, headers=GZ).status_code == 201
        assert [_say(c, f"m{i}") for i in range(1, 4)] == ["count=1", "count=2", "count=3"]
        one = _checkpoint_of(c, "m1")
    up.stop()
    sb = _instance(up)

    up.start("moorage.sandbox.microvm:MicroVMDriver.make_template")
    with up.client() as c:
        _in_background(lambda: c.post(f"/v1/agents/vm/users/ada/checkpoints/{one}/fork", json={"to_user": "bo"}))
        assert up.died()
    assert list((sb / "checkpoints").glob("tt-fork-*")), "the fork was killed after its way back was taken"

    up.start()
    with up.client() as c:
        assert _where(up, c) == _at(3)  # the source is back where it was
        assert list((sb / "checkpoints").glob("tt-fork-*")) == []
        assert _disk_snapshots(sb) == _named(sb)
        assert _say(c, "on") == "count=4"
