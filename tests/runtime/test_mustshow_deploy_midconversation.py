"""A deploy while users are mid-conversation loses no turn: every turn gets a reply (v1 or v2), none errors,
turns after the deploy get v2, and each user's files are intact.

Several users talk to the agent concurrently, each in its own session, turn after turn; the agent keeps a
notebook file in the user's sandbox. While they talk, v2 is deployed through the same runtime.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.store import EntityKey
from tests.runtime.conftest import write_agent

AGENT = '''
import asyncio, os

VERSION = %r

async def on_message(ctx, message):
    with open("/work/notebook.txt", "a") as f:
        f.write(message + "\\n")
    await asyncio.sleep(0.1)  # the turn is in flight for a while
    with open("/work/notebook.txt") as f:
        n = len(f.read().splitlines())
    return "%%s %%s #%%d" %% (VERSION, message, n)
'''

USERS = [f"user{i}" for i in range(4)]


@pytest.mark.timeout(170)
async def test_deploy_while_users_talk_loses_no_turn(env, tmp_path: Path) -> None:
    rt = env.runtime
    await rt.deploy(env.principal, write_agent(tmp_path / "v1", "notes", AGENT % "v1"))
    v2_dir = write_agent(tmp_path / "v2", "notes", AGENT % "v2")
    deployed = asyncio.Event()
    clock = asyncio.get_running_loop().time
    turns: list[tuple[float, float]] = []  # (sent, replied) of every turn
    deploy_span: list[float] = []  # [started, finished]
    started = {u: asyncio.Event() for u in USERS}
    replies: dict[str, list[str]] = {u: [] for u in USERS}
    sent: dict[str, list[str]] = {u: [] for u in USERS}
    after_deploy: dict[str, list[str]] = {u: [] for u in USERS}

    async def talk(user: str) -> None:
        k = EntityKey("notes", user, session="chat")
        n = 0
        extra = 0
        while extra < 2:  # keep talking until two turns were sent after the deploy finished
            was_deployed = deployed.is_set()
            msg = f"{user}-m{n}"
            sent[user].append(msg)
            t0 = clock()
            r = await rt.invoke(env.principal, k, msg)
            turns.append((t0, clock()))
            assert r.status == "done", (user, msg, r)
            replies[user].append(r.reply)
            if was_deployed:
                after_deploy[user].append(r.reply)
                extra += 1
            started[user].set()
            n += 1

    async def deploy_v2() -> int:
        await asyncio.gather(*(e.wait() for e in started.values()))  # every user is mid-conversation
        deploy_span.append(clock())
        dep = await rt.deploy(env.principal, v2_dir)
        deploy_span.append(clock())
        deployed.set()
        return dep.number

    results = await asyncio.wait_for(asyncio.gather(deploy_v2(), *(talk(u) for u in USERS)), timeout=150)
    assert results[0] == 2

    ts = env.store.tenant(env.principal)
    for user in USERS:
        # Every turn sent got its reply, in order, from one version or the other; none lost, none doubled.
        assert len(replies[user]) == len(sent[user])
        for i, (msg, reply) in enumerate(zip(sent[user], replies[user])):
            version, echoed, count = reply.split()
            assert version in ("v1", "v2") and echoed == msg and count == f"#{i + 1}", (user, reply)
        versions = [r.split()[0] for r in replies[user]]
        assert versions == sorted(versions), versions  # once on v2, never back to v1
        assert [r.split()[0] for r in after_deploy[user]] == ["v2", "v2"]
        # The user's files outlived the new version: the notebook has every message, once, in order.
        (rec,) = [r for r in ts.sandboxes.list(agent_id="notes") if r.scope.user == user]
        text = (await rt.read_file(env.principal, rec.id, "/work/notebook.txt")).decode()
        assert text.splitlines() == sent[user]
    # Turns were in flight on both sides of the deploy (it happened mid-conversation for everyone).
    assert all(r.split()[0] == "v1" for u in USERS for r in replies[u][:1])
    runs = [r for r in ts.runs.list(limit=1000) if r.name == "turn"]
    assert len(runs) == sum(len(s) for s in sent.values())
    assert {r.status for r in runs} == {"succeeded"}
    # The deploy really overlapped the conversations: turns were in flight while it was being built (a turn
    # lasts ~0.1 s; a deploy can be quicker, so "in flight", not "completed", during it).
    start, end = deploy_span
    assert any(sent_at < end and replied_at > start for sent_at, replied_at in turns), (deploy_span, turns)
