"""Forgetting a user leaves nothing of them: every memory tier, runs, journal, sandbox disk and snapshots."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from moorage.store import EntityKey, Scope
from tests.runtime.conftest import write_agent

AGENT = '''
async def on_message(ctx, message):
    ctx.files.write("diary.txt", message)
    await ctx.memory.remember("note: " + message)
    await ctx.step("echo", lambda: message)
    return "kept: " + message
'''


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            try:
                if needle in p.read_bytes():
                    hits.append(p)
            except OSError:
                continue
    return hits


async def test_forget_removes_every_byte_of_the_user(env, tmp_path: Path) -> None:
    root = write_agent(tmp_path / "agent", "diary", AGENT)
    await env.runtime.deploy(env.principal, root)
    alice_secret = f"alicesecret{uuid.uuid4().hex}"
    bob_secret = f"bobsecret{uuid.uuid4().hex}"
    await env.runtime.invoke(env.principal, EntityKey("diary", "alice"), f"my favourite colour is {alice_secret}")
    await env.runtime.invoke(env.principal, EntityKey("diary", "alice", session="s2"), f"remember {alice_secret}")
    await env.runtime.invoke(env.principal, EntityKey("diary", "bob"), f"my favourite colour is {bob_secret}")
    ts = env.store.tenant(env.principal)
    await env.manager.sleep(ts, Scope.for_user("diary", "alice"))  # a snapshot on disk too
    data = env.cfg.data_dir
    assert _files_containing(data, alice_secret.encode()), "the secret was never written; the test proves nothing"

    await env.runtime.forget(env.principal, "diary", "alice")

    assert _files_containing(data, alice_secret.encode()) == []
    assert _files_containing(data, bob_secret.encode())  # bob's data is still there
    assert ts.events.list(Scope.session("diary", "alice", "default")) == []
    assert ts.sandboxes.list(agent_id="diary") and all(s.scope.user == "bob" for s in ts.sandboxes.list(agent_id="diary"))
    # Alice can come back: she starts from nothing.
    r = await env.runtime.invoke(env.principal, EntityKey("diary", "alice"), "hello again")
    assert r.reply == "kept: hello again"
