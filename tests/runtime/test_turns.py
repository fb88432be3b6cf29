"""End-to-end turns through the real runtime: deploy, template, sandbox, guest agent, host calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.errors import ConflictError, InvalidInput, NotFound, TenantScopeError
from moorage.runtime.package import AgentPackageError
from moorage.runtime.runtime import AgentTurnFailed
from moorage.store import EntityKey, Principal
from tests.runtime.conftest import write_agent

AGENT = '''
import os

async def on_message(ctx, message):
    if message.startswith("remember "):
        await ctx.memory.remember(message[len("remember "):])
        return "noted"
    if message.startswith("recall "):
        hits = await ctx.memory.recall(message[len("recall "):], k=1)
        return hits[0]["text"] if hits else "nothing"
    if message == "count":
        n = int(ctx.files.read("count.txt")) + 1 if ctx.files.exists("count.txt") else 1
        ctx.files.write("count.txt", str(n))
        return f"count={n} user={ctx.user}"
    if message == "env":
        return " ".join(sorted(os.environ))
    if message == "boom":
        raise RuntimeError("the agent broke")
    if message == "approve":
        first = await ctx.step("draft", lambda: "draft-1")
        answer = await ctx.interrupt({"question": "ship it?", "draft": first})
        return f"{first} -> {answer}"
    return "echo: " + message
'''


async def test_deploy_and_turns_keep_files_per_user(env, tmp_path: Path) -> None:
    dep = await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    assert dep.number == 1
    r1 = await env.runtime.invoke(env.principal, EntityKey("echo", "alice"), "count")
    r2 = await env.runtime.invoke(env.principal, EntityKey("echo", "alice"), "count")
    r3 = await env.runtime.invoke(env.principal, EntityKey("echo", "bob"), "count")
    assert (r1.reply, r2.reply, r3.reply) == ("count=1 user=alice", "count=2 user=alice", "count=1 user=bob")


async def test_memory_round_trip_through_the_host(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    alice = EntityKey("echo", "alice", session="s1")
    await env.runtime.invoke(env.principal, alice, "remember my locker code is 4512")
    later = EntityKey("echo", "alice", session="s2")
    r = await env.runtime.invoke(env.principal, later, "recall what is my locker code")
    assert "4512" in r.reply
    r_bob = await env.runtime.invoke(env.principal, EntityKey("echo", "bob"), "recall what is my locker code")
    assert "4512" not in r_bob.reply


async def test_no_host_secret_in_the_sandbox_environment(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    r = await env.runtime.invoke(env.principal, EntityKey("echo", "alice"), "env")
    names = set(r.reply.split())
    assert not any("KEY" in n or "TOKEN" in n or "SECRET" in n or n.startswith("MOORAGE_LLM") for n in names), names


async def test_idempotent_turns_replay(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    k = EntityKey("echo", "alice")
    a = await env.runtime.invoke(env.principal, k, "count", idempotency_key="req-1")
    b = await env.runtime.invoke(env.principal, k, "count", idempotency_key="req-1")
    c = await env.runtime.invoke(env.principal, k, "count", idempotency_key="req-2")
    assert a.reply == b.reply == "count=1 user=alice" and c.reply == "count=2 user=alice"


async def test_interrupt_then_answer_resumes_after_it(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    k = EntityKey("echo", "alice")
    r = await env.runtime.invoke(env.principal, k, "approve")
    assert r.status == "waiting" and r.interrupt == {"question": "ship it?", "draft": "draft-1"}
    done = await env.runtime.answer(env.principal, r.run_id, "yes")
    assert done.status == "done" and done.reply == "draft-1 -> yes"
    steps = env.store.tenant(env.principal).runs.steps(r.run_id)
    assert [(s.name, s.status, s.attempts) for s in steps] == [("draft", "succeeded", 1), ("approval", "answered", 1)]


async def test_broken_agents_give_clear_errors(env, tmp_path: Path) -> None:
    with pytest.raises(AgentPackageError, match="syntax error in agent.py line"):
        await env.runtime.deploy(env.principal, write_agent(tmp_path / "bad", "echo", "def on_message(ctx, m):\n  return (\n"))
    with pytest.raises(AgentPackageError, match="ModuleNotFoundError"):
        await env.runtime.deploy(env.principal, write_agent(tmp_path / "imp", "imp", "import not_a_module_xyz\n"))
    # Settings a turn would trip on fail the deploy instead: a sleep policy nobody knows, a misplaced table.
    with pytest.raises(AgentPackageError, match="unknown sleep policy 'sometimes'"):
        root = write_agent(tmp_path / "lc", "lc", AGENT)
        (root / "moorage.toml").write_text('[agent]\nname = "lc"\nentry = "agent.py"\n[agent.lifecycle]\n'
                                           'sleep = "sometimes"\n')
        await env.runtime.deploy(env.principal, root)
    with pytest.raises(AgentPackageError, match=r"top-level \[lifecycle\]") as e:
        (root / "moorage.toml").write_text('[agent]\nname = "lc"\nentry = "agent.py"\n[lifecycle]\nusers = "auto"\n')
        await env.runtime.deploy(env.principal, root)
    assert "[agent.lifecycle]" in (e.value.hint or "")
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    with pytest.raises(AgentTurnFailed, match="the agent broke"):
        await env.runtime.invoke(env.principal, EntityKey("echo", "alice"), "boom")
    # The agent is not stuck: the next turn works.
    assert (await env.runtime.invoke(env.principal, EntityKey("echo", "alice"), "hi")).reply == "echo: hi"


async def test_a_deploy_that_fails_to_build_is_listed_as_failed_and_never_live(env, tmp_path: Path) -> None:
    ts = env.store.tenant(env.principal)
    with pytest.raises(AgentPackageError, match="ModuleNotFoundError"):
        await env.runtime.deploy(env.principal, write_agent(tmp_path / "imp", "imp", "import not_a_module_xyz\n"))
    agent = ts.agents.get("imp")
    assert [(d.number, d.status) for d in ts.deployments.list(agent.id)] == [(1, "failed")]
    assert agent.live_deployment is None
    with pytest.raises(ConflictError, match="is failed, it never went live"):
        await env.runtime.rollback(env.principal, "imp", 1)
    good = await env.runtime.deploy(env.principal, write_agent(tmp_path / "ok", "imp", AGENT))
    assert (good.number, good.status) == (2, "ready")
    with pytest.raises(AgentPackageError):
        await env.runtime.deploy(env.principal, write_agent(tmp_path / "imp3", "imp", "import not_a_module_xyz\n"))
    assert [(d.number, d.status) for d in ts.deployments.list(agent.id)] == [(1, "failed"), (2, "ready"), (3, "failed")]
    assert ts.agents.get("imp").live_deployment == good.id  # the failed one changed nothing
    with pytest.raises(NotFound, match="no earlier deployment"):
        await env.runtime.rollback(env.principal, "imp")  # the failed #1 is no target


async def test_unknown_agent_and_foreign_tokens(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    with pytest.raises(NotFound):
        await env.runtime.invoke(env.principal, EntityKey("ghost", "alice"), "hi")
    assert env.store.tenant(env.principal).sandboxes.list() == [] or all(
        s.agent_id == "echo" for s in env.store.tenant(env.principal).sandboxes.list())
    token = Principal(env.principal.tenant_id, frozenset({"invoke"}), agent="echo", user="alice")
    with pytest.raises(TenantScopeError):
        await env.runtime.invoke(token, EntityKey("echo", "bob"), "count")


async def test_new_deploy_reaches_existing_users_with_their_files(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "v1", "echo", AGENT))
    k = EntityKey("echo", "alice")
    await env.runtime.invoke(env.principal, k, "count")
    v2 = AGENT.replace('"echo: " + message', '"v2: " + message')
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "v2", "echo", v2))
    assert (await env.runtime.invoke(env.principal, k, "hi")).reply == "v2: hi"
    assert (await env.runtime.invoke(env.principal, k, "count")).reply == "count=2 user=alice"
    await env.runtime.rollback(env.principal, "echo")
    assert (await env.runtime.invoke(env.principal, k, "hi")).reply == "echo: hi"


async def test_unknown_user_is_404_and_writes_nothing(env, tmp_path: Path) -> None:
    root = write_agent(tmp_path / "strict", "strict", AGENT)
    (root / "moorage.toml").write_text('[agent]\nname = "strict"\nentry = "agent.py"\n')  # users: existing (default)
    await env.runtime.deploy(env.principal, root)
    ts = env.store.tenant(env.principal)
    with pytest.raises(NotFound, match="no user 'mallory'"):
        await env.runtime.invoke(env.principal, EntityKey("strict", "mallory"), "count")
    assert ts.runs.list() == [] and ts.sandboxes.list() == []
    ts.agent_users.put("strict", "carol")  # the product registers its end-user with this agent first
    assert (await env.runtime.invoke(env.principal, EntityKey("strict", "carol"), "count")).reply == "count=1 user=carol"


STEPS = '''
async def on_message(ctx, message):
    if message == "tuple":
        a = await ctx.step("t", lambda: (1, 2))
        return type(a).__name__ + " " + str(a)
    if message == "fail":
        def boom():
            raise ValueError("card declined")
        try:
            await ctx.step("bad", boom, retries=0)
        except ctx.StepFailed as e:
            return type(e).__name__ + ": " + str(e)
    if message == "set":
        try:
            await ctx.step("obj", lambda: {1, 2})
        except Exception as e:
            failed = type(e).__name__ + ": " + str(e)
        answer = await ctx.interrupt({"after": failed})
        return answer
    a = await ctx.step(STEP, lambda: (1, 2))
    answer = await ctx.interrupt({"q": "ok?"})
    return str(a) + " " + answer
'''


async def test_steps_return_and_fail_the_same_way_live_and_on_replay(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "a", "steps", 'STEP = "a"\n' + STEPS))
    k = EntityKey("steps", "ada")
    assert (await env.runtime.invoke(env.principal, k, "tuple")).reply == "list [1, 2]"  # as the journal holds it
    assert (await env.runtime.invoke(env.principal, k, "fail")).reply.startswith("StepFailed: step 'bad' failed: ValueError")
    # A result that is not a JSON value fails the step clearly, and the workflow goes on from the next position.
    r = await env.runtime.invoke(env.principal, k, "set")
    assert r.status == "waiting" and "is not a JSON value" in r.interrupt["after"], r.interrupt
    assert (await env.runtime.answer(env.principal, r.run_id, "fine")).reply == "fine"


async def test_a_non_deterministic_replay_leaves_the_run_for_a_corrected_deployment(env, tmp_path: Path) -> None:
    from moorage.durable import NonDeterminismError

    await env.runtime.deploy(env.principal, write_agent(tmp_path / "v1", "nd", 'STEP = "a"\n' + STEPS))
    k = EntityKey("nd", "ada")
    r = await env.runtime.invoke(env.principal, k, "go", idempotency_key="order-1")
    assert r.status == "waiting"
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "v2", "nd", 'STEP = "b"\n' + STEPS))
    with pytest.raises(NonDeterminismError, match="position 0"):
        await env.runtime.answer(env.principal, r.run_id, "yes")
    ts = env.store.tenant(env.principal)
    assert ts.runs.get(r.run_id).status == "pending"  # not failed: left for a corrected deployment
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "v3", "nd", 'STEP = "a"\n' + STEPS))
    done = await env.runtime.invoke(env.principal, k, "go", idempotency_key="order-1")  # the same turn, resumed
    assert (done.status, done.reply) == ("done", "[1, 2] yes")
    assert ts.runs.get(r.run_id).status == "succeeded"


async def test_an_idempotency_key_names_one_turn_and_one_message(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", AGENT))
    k = EntityKey("echo", "alice")
    first = await env.runtime.invoke(env.principal, k, "count", idempotency_key="k-1")
    again = await env.runtime.invoke(env.principal, k, "count", idempotency_key="k-1")
    assert first.reply == again.reply == "count=1 user=alice"  # the same turn, not a second one
    with pytest.raises(InvalidInput, match="different request"):
        await env.runtime.invoke(env.principal, k, "hi", idempotency_key="k-1")
    # The same message in another session is another request too (it was answered with the first session's turn).
    with pytest.raises(InvalidInput, match="different request"):
        await env.runtime.invoke(env.principal, EntityKey("echo", "alice", "other"), "count", idempotency_key="k-1")
    assert (await env.runtime.invoke(env.principal, k, "count")).reply == "count=2 user=alice"


FLOOD = '''
async def on_message(ctx, message):
    kept, refused = 0, ""
    for i in range(int(message)):
        try:
            await ctx.memory.remember(("%d " % i) + "x" * 200_000)
            kept += 1
        except Exception as e:
            refused = "%s %s: %s" % (type(e).__name__, getattr(e, "kind", None), e)
            break
    hits = await ctx.memory.recall("x", k=1)  # reads go on past the limit
    return "%d kept; %d found; %s" % (kept, len(hits), refused)
'''


async def test_a_turns_store_writes_are_bounded_and_the_next_turn_writes_again(env, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A loop in the agent's code that remembers large texts stops at the turn's bound (1 MiB here, 256 MiB by
    # default) with an error it can read; what it kept stays, and the next turn has a bound of its own.
    from moorage.runtime import host_calls

    monkeypatch.setattr(host_calls, "STORE_WRITES_PER_TURN", 1 << 20)
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "echo", FLOOD))
    ada = EntityKey("echo", "ada")
    first = (await env.runtime.invoke(env.principal, ada, "50")).reply
    assert first.startswith("5 kept; 1 found; ") and "more than one turn may (1 MiB)" in first, first
    assert "HostError turn-store-limit: " in first and "memory.append refused" in first
    assert (await env.runtime.invoke(env.principal, ada, "2")).reply == "2 kept; 1 found; "
