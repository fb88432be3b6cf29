"""Automatic checkpoints (on by default) are taken after the turn's reply went out and before the next turn of
the instance runs; one that fails never fails the turn and is listed as missing. ``ctx.checkpoint(name)`` from
agent code takes a named checkpoint at that point of the turn. Real runtime, process sandboxes, SQLite."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from moorage.errors import ConflictError
from moorage.store import EntityKey, Scope
from moorage.store.model import FACT_STATUS
from moorage.store.repos.checkpoints import Checkpoints
from tests.runtime.conftest import Env, write_agent
from tests.timetravel.conftest import AGENT

MIGRATING = '''
import json

async def on_message(ctx, message):
    if message == "migrate":
        ctx.files.write("old.txt", "before")
        await ctx.memory.learn("user", "schema", "v1", "the schema is v1")
        ck = await ctx.checkpoint("before-migration")
        ctx.files.write("new.txt", "after")
        await ctx.memory.learn("user", "schema", "v2", "the schema is v2")
        return json.dumps({"ck": ck["id"], "name": ck["name"]})
    if message == "ls":
        return json.dumps(sorted(n for n in ctx.files.list(".") if n.endswith(".txt")))
    return "echo: " + message
'''


def _say(env: Env, user: str, message: str, agent: str = "tt"):
    return env.runtime.invoke(env.principal, EntityKey(agent, user), message)


async def _stream_reply(env: Env, user: str, message: str) -> str:
    async for ev in env.runtime.stream(env.principal, EntityKey("tt", user), message):
        if ev.kind == "done":
            return ev.data.reply
    raise AssertionError("no done event")


async def test_the_reply_goes_out_before_the_checkpoint_which_comes_before_the_next_turn(env: Env, tmp_path: Path) -> None:
    # No [agent.timetravel] table: automatic checkpoints are the default.
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT))
    assert (await _say(env, "ada", "turn 1")).reply.startswith("done 1")
    ts = env.store.tenant(env.principal)
    repo = Checkpoints(ts)
    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    assert [(c["kind"], c["summary"]["turn"]["message"]) for c in listing["data"]] == [("turn", "turn 1")]

    # The sandbox's own lock held by the test: its checkpoint cannot be taken until released. The reply of
    # turn 2 still comes back, so the checkpoint is not on its path.
    rec = ts.sandboxes.for_scope(Scope.for_user("tt", "ada"))
    sandbox = await env.runtime.driver.open(rec.id)
    await sandbox._lock.acquire()
    try:
        reply2 = await asyncio.wait_for(_stream_reply(env, "ada", "turn 2"), 120)  # a guard, not a timing
        assert reply2.startswith("done 2")
        assert [c.summary["turn"]["message"] for c in repo.list("tt", "ada")] == ["turn 1"]
        # Turn 3 arrives meanwhile: it waits for turn 2's checkpoint (the instance is still held by turn 2).
        third = asyncio.create_task(_say(env, "ada", "turn 3"))
        await asyncio.sleep(0.5)
        assert not third.done()
        assert not (env.cfg.sandboxes_dir / rec.id / "layer" / "work" / "notes" / "3.txt").exists()
    finally:
        sandbox._lock.release()
    assert (await asyncio.wait_for(third, 120)).reply.startswith("done 3")

    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")  # waits for turn 3's checkpoint
    by_msg = {c["summary"]["turn"]["message"]: c for c in listing["data"]}
    assert sorted(by_msg) == ["turn 1", "turn 2", "turn 3"]
    # Turn 2's checkpoint holds turn 2's files and not turn 3's: taken before turn 3 ran.
    layer = env.cfg.sandboxes_dir / rec.id / "checkpoints" / by_msg["turn 2"]["sandbox_checkpoint"] / "layer" / "work"
    assert sorted(p.name for p in (layer / "notes").iterdir()) == ["1.txt", "2.txt"]
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", by_msg["turn 2"]["id"])
    assert sorted(json.loads((await _say(env, "ada", "ls")).reply)) == ["1.txt", "2.txt"]


async def test_a_failed_checkpoint_never_fails_the_turn_and_is_listed_as_missing(env: Env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT))
    await _say(env, "ada", "turn 1")
    ts = env.store.tenant(env.principal)
    rec = ts.sandboxes.for_scope(Scope.for_user("tt", "ada"))
    await env.runtime.timetravel.list(env.principal, "tt", "ada")
    # The driver cannot write a checkpoint: its checkpoints directory is a file now.
    ck_dir = env.cfg.sandboxes_dir / rec.id / "checkpoints"
    aside = ck_dir.with_name("checkpoints.aside")
    ck_dir.rename(aside)
    ck_dir.write_text("not a directory")
    try:
        assert (await _say(env, "ada", "turn 2")).reply.startswith("done 2")  # the turn succeeded
        listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    finally:
        ck_dir.unlink()
        aside.rename(ck_dir)
    missing, first = listing["data"]
    assert missing["kind"] == "missing" and missing["summary"]["turn"]["message"] == "turn 2"
    assert missing["summary"]["turn"]["status"] == "succeeded" and missing["summary"]["error"]
    assert missing["sandbox_checkpoint"] is None and first["summary"]["turn"]["message"] == "turn 1"
    assert listing["head"] == first["id"]  # a missing checkpoint is no point of the branch
    with pytest.raises(ConflictError, match="missing"):
        await env.runtime.timetravel.rollback(env.principal, "tt", "ada", missing["id"])
    with pytest.raises(ConflictError, match="missing"):
        await env.runtime.timetravel.fork(env.principal, "tt", "ada", missing["id"], ["bea"])

    # The next turn checkpoints again, and rolling back to turn 1 across the gap works.
    await _say(env, "ada", "turn 3")
    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    assert [c["kind"] for c in listing["data"]] == ["turn", "missing", "turn"]
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", first["id"])
    assert sorted(json.loads((await _say(env, "ada", "ls")).reply)) == ["1.txt"]


async def test_ctx_checkpoint_takes_the_instance_at_that_point_of_the_turn(env: Env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "mig", MIGRATING,
                                                        extra_manifest="[agent.timetravel]\nauto = false\n"))
    out = json.loads((await _say(env, "ada", "migrate", agent="mig")).reply)
    assert out["name"] == "before-migration"
    ts = env.store.tenant(env.principal)
    facts = lambda: sorted(f.value for f in ts.facts.list(Scope.for_user("mig", "ada"), statuses=FACT_STATUS))  # noqa: E731
    assert facts() == ["v1", "v2"]
    assert json.loads((await _say(env, "ada", "ls", agent="mig")).reply) == ["new.txt", "old.txt"]

    listing = await env.runtime.timetravel.list(env.principal, "mig", "ada")
    (ck,) = listing["data"]  # automatic checkpoints are off for this agent: only the named one
    assert ck["id"] == out["ck"] and ck["kind"] == "manual" and ck["name"] == "before-migration"
    turn_id = ck["summary"]["during_turn"]

    await env.runtime.timetravel.rollback(env.principal, "mig", "ada", ck["id"])
    # Files and facts as they were at that point of the turn: what came after it is gone.
    assert json.loads((await _say(env, "ada", "ls", agent="mig")).reply) == ["old.txt"]
    assert facts() == ["v1"]
    run = ts.runs.get(turn_id)
    assert run.status == "failed" and "taken during this turn" in (run.error or "")
    # Nothing resumes that turn: a host restart's recovery finds no turn of this user to run on.
    assert [r.id for r in ts.runs.list(status=["running", "pending"], limit=100) if r.scope.agent == "mig"] == []
    # The agent goes on from there.
    again = json.loads((await _say(env, "ada", "migrate", agent="mig")).reply)
    assert again["ck"] != ck["id"]
    assert facts() == ["v1", "v2"]
