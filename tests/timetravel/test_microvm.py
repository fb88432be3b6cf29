"""Time travel on the micro-VM driver: a rollback restores the guest's memory (a counter held by the agent's
long-running process) with its files and store state; a fork carries that memory into the new user's VM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.sandbox import microvm_ram_chain as ram_chain
from moorage.store import EntityKey, Scope
from tests.runtime.conftest import Env, make_env, write_agent
from tests.timetravel.conftest import store_view

AGENT = '''
import json

COUNT = 0  # lives in the guest's agent process: only a memory snapshot keeps it

async def on_message(ctx, message):
    global COUNT
    if message == "ls":
        return json.dumps(sorted(ctx.files.list("notes")))
    COUNT += 1
    ctx.files.write(f"notes/{COUNT}.txt", message)
    await ctx.memory.learn("user", "count", str(COUNT), f"count is {COUNT}")
    return f"count={COUNT}"
'''


@pytest.fixture
async def vm_env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "microvm"):
        yield e


async def test_rollback_and_fork_carry_the_guest_memory(vm_env: Env, tmp_path: Path) -> None:
    env = vm_env
    assert env.runtime.driver.name == "microvm"
    # Automatic checkpoints opted into (the micro-VM driver's default is off), with the default retention.
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "vm", AGENT,
                                                        extra_manifest="[agent.timetravel]\nauto = true\n"))
    ts = env.store.tenant(env.principal)

    async def say(user: str, message: str) -> str:
        return (await env.runtime.invoke(env.principal, EntityKey("vm", user), message)).reply

    assert [await say("ada", f"m{i}") for i in range(1, 5)] == ["count=1", "count=2", "count=3", "count=4"]
    listing = await env.runtime.timetravel.list(env.principal, "vm", "ada")
    two = next(c for c in listing["data"] if c["summary"]["turn"]["message"] == "m2")

    await env.runtime.timetravel.rollback(env.principal, "vm", "ada", two["id"])
    assert json.loads(await say("ada", "ls")) == ["1.txt", "2.txt"]
    assert [f[1] for f in store_view(ts, "vm", "ada")["facts"]] == ["1", "2"]
    assert await say("ada", "again") == "count=3"  # the process's memory came back with the files

    out = await env.runtime.timetravel.fork(env.principal, "vm", "ada", two["id"], ["bea"])
    assert out["forks"][0]["sandbox_id"]
    assert await say("bea", "fork") == "count=3"
    assert json.loads(await say("bea", "ls")) == ["1.txt", "2.txt", "3.txt"]
    assert await say("ada", "next") == "count=4"  # the source is where it was


def _disk_snapshots(sandbox_dir: Path) -> set[str]:
    """The qcow2 internal snapshots of a sandbox's disk (``-U``: readable while QEMU holds the image)."""
    import subprocess

    out = subprocess.run(["qemu-img", "snapshot", "-l", "-U", str(sandbox_dir / "disk.qcow2")], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines()[2:] if len(line.split()) > 1}


async def test_retention_deletes_micro_vm_checkpoints(vm_env: Env, tmp_path: Path) -> None:
    env = vm_env
    # Automatic checkpoints (opted into on this driver); retention keeps the newest 2 of the branch (and every
    # branch's tip).
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "vm", AGENT, extra_manifest=(
        "[agent.timetravel]\nauto = true\nkeep = 2\ndaily = 0\n")))

    async def say(message: str) -> str:
        return (await env.runtime.invoke(env.principal, EntityKey("vm", "ada"), message)).reply

    for i in range(1, 10):
        await say(f"m{i}")
    listing = await env.runtime.timetravel.list(env.principal, "vm", "ada")
    sandbox = await env.runtime.driver.open(listing["data"][0]["sandbox_id"])
    assert len(await sandbox.checkpoints()) == 9  # retention runs at every 10th checkpoint

    assert await say("m10") == "count=10"  # the 10th checkpoint: retention prunes
    listing = await env.runtime.timetravel.list(env.principal, "vm", "ada")
    kept = {c["sandbox_checkpoint"] for c in listing["data"]}
    assert [c["summary"]["turn"]["message"] for c in listing["data"]] == ["m10", "m9"]
    # The pruned ones are gone from the driver too: their RAM and device state, and their disk snapshots.
    assert {c.name for c in await sandbox.checkpoints()} == kept
    assert _disk_snapshots(sandbox.dir) == {f"ckpt-{n}" for n in kept}
    assert sorted(p.name for p in (sandbox.dir / "checkpoints").iterdir()) == sorted(kept)

    # What is kept still restores, memory included.
    nine = next(c for c in listing["data"] if c["summary"]["turn"]["message"] == "m9")
    await env.runtime.timetravel.rollback(env.principal, "vm", "ada", nine["id"])
    assert await say("again") == "count=10"
    assert json.loads(await say("ls")) == sorted(f"{i}.txt" for i in range(1, 11))

    # A sleeping VM's checkpoint is deleted without QEMU (qemu-img on the disk).
    extra = await sandbox.checkpoint("extra")
    assert f"ckpt-{extra.name}" in _disk_snapshots(sandbox.dir)
    assert await env.runtime.instances.sleep(env.store.tenant(env.principal), Scope.for_user("vm", "ada"))
    await sandbox.delete_checkpoint("extra")
    assert "extra" not in {c.name for c in await sandbox.checkpoints()}
    assert "ckpt-extra" not in _disk_snapshots(sandbox.dir)
    # Its RAM pages stay only while a listed checkpoint taken after it builds on them (microvm_ram_chain).
    cps = sandbox.dir / "checkpoints"
    built_on = any("extra" in [d.name for d in ram_chain.chain(cps, c.name)] for c in await sandbox.checkpoints())
    assert (cps / "extra").exists() == built_on and not (cps / "extra" / "snapshot.json").exists()
    assert await say("after sleep") == "count=11"  # wakes from its sleep snapshot as before


MIGRATING = '''
import json

async def on_message(ctx, message):
    if message == "migrate":
        ctx.files.write("old.txt", "before")
        try:
            await ctx.checkpoint("before-migration")
        except Exception as e:  # what a restored guest's agent would see if its call were failed, not cancelled
            ctx.files.write("failed.txt", repr(e))
            raise
        ctx.files.write("new.txt", "after")
        return "migrated"
    if message == "ls":
        return json.dumps(sorted(n for n in ctx.files.list(".") if n.endswith(".txt")))
    return "echo: " + message
'''


async def test_a_rollback_to_a_checkpoint_taken_during_a_turn_leaves_no_turn_waiting_in_the_guest(
        vm_env: Env, tmp_path: Path) -> None:
    """The guest restored at ``ctx.checkpoint`` is inside that call, whose host is gone: the wake's first call
    tells it so, and the old turn's code is cancelled there (it writes nothing more), not left waiting for an
    answer while the next turns run."""
    env = vm_env
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "mig", MIGRATING,
                                                        extra_manifest="[agent.timetravel]\nauto = false\n"))

    async def say(message: str) -> str:
        # A guard, not a timing: a turn stuck behind the restored one would wait for the call's 300 s timeout.
        return (await asyncio.wait_for(env.runtime.invoke(env.principal, EntityKey("mig", "ada"), message), 120)).reply

    assert await say("migrate") == "migrated"
    (ck,) = (await env.runtime.timetravel.list(env.principal, "mig", "ada"))["data"]
    assert ck["summary"]["during_turn"]
    await env.runtime.timetravel.rollback(env.principal, "mig", "ada", ck["id"])
    assert json.loads(await say("ls")) == ["old.txt"]
    assert json.loads(await say("ls")) == ["old.txt"]  # the restored turn wrote neither new.txt nor failed.txt
    assert await say("migrate") == "migrated"
    assert json.loads(await say("ls")) == ["new.txt", "old.txt"]
