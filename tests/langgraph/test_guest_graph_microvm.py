"""Example 5 (examples/langgraph) end to end on micro-VMs, as shipped (a checkpoint after every turn): LangGraph
installed at deploy time in the builder VM from the loopback index (through the channel's relay and the host's
gateway), the graph's state in the user's store rows, its interrupt() a moorage interrupt, and rollback and fork
moving its checkpoints with the VM. Helpers and fixtures are the process driver's; the example is deployed once."""

from __future__ import annotations

from typing import AsyncIterator

import pytest
import pytest_asyncio

from moorage.runtime.graph_calls import PREFIX
from moorage.store import Scope
from tests.langgraph.test_guest_graph import (AGENT, EXAMPLE, _env, approve_a_plan, ask, graph_rows,  # noqa: F401
                                              index, will_say, wire)
from tests.llm.wire_servers import WireServer
from tests.runtime.conftest import Env

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory, index: int, wire: WireServer) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("lg-vm")
    async for e in _env(tmp, index, wire, "microvm"):
        await e.runtime.deploy(e.principal, EXAMPLE)  # as shipped: `auto = true`, 512 MiB; pip in the builder VM
        yield e


async def turn_checkpoints(env: Env, user: str) -> list[dict]:
    """The user's automatic checkpoints, newest first."""
    listing = await env.runtime.timetravel.list(env.principal, AGENT, user)
    return [c for c in listing["data"] if c["kind"] == "turn"]


async def done_files(env: Env, user: str) -> str:
    """What the graph's act node wrote on the user's VM disk (``ctx.files`` under /work)."""
    rec = env.store.tenant(env.principal).sandboxes.for_scope(Scope.for_user(AGENT, user))
    r = await (await env.runtime.driver.open(rec.id)).exec(["sh", "-c", "ls /work/done 2>/dev/null"], timeout=60)
    return r.stdout.decode().strip()


async def test_the_graph_keeps_its_state_in_the_users_store_rows(env: Env) -> None:
    assert (await ask(env, "ada", "note buy milk")).reply == "notes: buy milk"
    assert (await ask(env, "ada", "note call mum")).reply == "notes: buy milk, call mum"
    assert (await ask(env, "ada", "note elsewhere", session="s2")).reply == "notes: elsewhere"
    rows = graph_rows(env, "ada")
    assert any(k.startswith(PREFIX + "default/") for k in rows) and any(k.startswith(PREFIX + "s2/") for k in rows)
    # The VM sleeps (its RAM to a snapshot) and wakes: the graph carries on from the same rows.
    ts = env.store.tenant(env.principal)
    assert await env.manager.sleep(ts, Scope.for_user(AGENT, "ada"))
    assert (await ask(env, "ada", "note after sleep")).reply == "notes: buy milk, call mum, after sleep"
    assert len(await turn_checkpoints(env, "ada")) == 4  # the example's `auto = true`: one per turn


async def test_interrupt_waits_as_a_moorage_interrupt_and_the_answer_resumes_the_graph(env: Env,
                                                                                     wire: WireServer) -> None:
    await approve_a_plan(env, wire)


async def test_rollback_and_fork_move_the_graphs_checkpoints_with_the_vm(env: Env, wire: WireServer) -> None:
    for n in (1, 2):
        await ask(env, "dee", f"note n{n}")
    at2 = (await turn_checkpoints(env, "dee"))[0]["id"]  # the automatic checkpoint of turn 2 (newest first)
    rows2 = graph_rows(env, "dee")
    will_say(wire, "With a broom.")
    waiting = await ask(env, "dee", "do sweep the floor")
    assert (await env.runtime.answer(env.principal, waiting.run_id, "yes")).reply.endswith("(1 done so far)")
    rows3 = graph_rows(env, "dee")
    assert len(rows3) > len(rows2) and await done_files(env, "dee") == "1.txt"

    # Fork at turn 2 into a new user: its VM and its graph continue from n1, n2 alone; the source is unchanged.
    await env.runtime.timetravel.fork(env.principal, AGENT, "dee", at2, to_users=["dee-what-if"])
    assert graph_rows(env, "dee-what-if") == rows2
    assert (await ask(env, "dee-what-if", "note w")).reply == "notes: n1, n2, w"
    assert await done_files(env, "dee-what-if") == ""
    assert graph_rows(env, "dee") == rows3 and await done_files(env, "dee") == "1.txt"

    # Roll back to turn 2: the graph's rows are those of turn 2, the file the approved task wrote in the VM is
    # gone with them, and asking again pauses at the question again, as a first time would.
    await env.runtime.timetravel.rollback(env.principal, AGENT, "dee", at2)
    assert graph_rows(env, "dee") == rows2 and await done_files(env, "dee") == ""
    will_say(wire, "With a broom.")
    again = await ask(env, "dee", "do sweep the floor")
    assert again.status == "waiting"
    assert (await env.runtime.answer(env.principal, again.run_id, "yes")).reply.endswith("(1 done so far)")
    assert (await ask(env, "dee", "note n3")).reply == "notes: n1, n2, n3"
