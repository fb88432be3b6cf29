"""Time travel on the micro-VM driver: a rollback restores the guest's memory (a counter held by the agent's
long-running process) with its files and store state; a fork carries that memory into the new user's VM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.store import EntityKey
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
    # Automatic checkpoints are opted into (and the micro-VM driver cannot delete them yet: no retention here).
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
