"""Corrections and failures outlive their turn: the user's later turns of the same agent see them, with the turn
that wrote each; another user of the agent does not; forgetting the user removes them.

On both store backends through the durable engine, and end to end through a runtime whose agent reads
``ctx.history()`` and a built-in loop whose model input gets the user's corrections in the user turn.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from moorage.config import Config
from moorage.durable import NO_WAIT, DurableEngine, StepFailed
from moorage.durable.runlog import USER_LOG_PREFIX, earlier_entries
from moorage.runtime.host import Host
from moorage.store import EntityKey, Scope, TenantStore
from tests.conftest import stop_all_sandboxes
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app
from tests.runtime.conftest import write_agent

AGENT = '''
import json


def broken():
    raise RuntimeError("supplier API down")


async def on_message(ctx, message):
    if message.startswith("no, "):
        await ctx.correct(message[4:])
    if message == "fail":
        try:
            await ctx.step("order", broken, retries=0)
        except Exception:
            pass
    return json.dumps({"turn": ctx.turn_id, "history": await ctx.history()})
'''


def _user_log(ts: TenantStore, agent: str, user: str) -> list[Any]:
    return ts.state.list(Scope.for_user(agent, user), prefix=USER_LOG_PREFIX)


# -- the engine, on SQLite and PostgreSQL ------------------------------------------------------------------


async def test_corrections_and_failures_reach_the_users_later_runs(tenant: TenantStore) -> None:
    async def wf(ctx: Any, input: Any) -> Any:
        if input.get("correct"):
            ctx.correct(input["correct"])
        if input.get("fail"):
            try:
                await ctx.step("charge", _raise, retries=1, backoff=NO_WAIT)
            except StepFailed:
                pass
        return "ok"

    engine = DurableEngine(tenant, {"wf": wf})
    one = await engine.start(Scope.workflow("shop", "t1", "ada"), "wf", input={"correct": "ship to the office", "fail": True})
    other = await engine.start(Scope.workflow("shop", "b1", "bob"), "wf", input={"correct": "bob's own note"})
    two = await engine.start(Scope.workflow("shop", "t2", "ada"), "wf", input={})
    assert one.status == other.status == two.status == "succeeded"

    seen = earlier_entries(tenant, two.id)
    # Oldest first: the two failed attempts of the step (the second settled it), and the correction before them.
    assert [(e["kind"], e["status"]) for e in seen] == [("correction", "correction"), ("attempt", "retry"),
                                                        ("step", "failed")]
    assert {e["turn_id"] for e in seen} == {one.id}
    assert seen[0]["note"] == "ship to the office" and "card declined" in seen[2]["error"]
    assert all(isinstance(e["at"], float) and e["at"] < two.created_at for e in seen)
    # Bob's log is his own; a run reads nothing of its own run here (its log is the run's), nor anything later.
    assert [e["note"] for e in earlier_entries(tenant, other.id)] == []
    assert earlier_entries(tenant, one.id) == []
    three = await engine.start(Scope.workflow("shop", "b2", "bob"), "wf", input={})
    assert [(e["note"], e["turn_id"]) for e in earlier_entries(tenant, three.id)] == [("bob's own note", other.id)]

    # An outside correction on a finished run lands in the user's log too.
    engine.correct(two.id, "call before delivering")
    four = await engine.start(Scope.workflow("shop", "t4", "ada"), "wf", input={})
    assert [(e["kind"], e["note"], e["turn_id"]) for e in earlier_entries(tenant, four.id)][-1] == \
        ("note", "call before delivering", two.id)

    tenant.forget_user("ada", "shop")
    assert _user_log(tenant, "shop", "ada") == []
    assert len(_user_log(tenant, "shop", "bob")) == 1


def _raise() -> None:
    raise RuntimeError("card declined")


# -- end to end: the agent's ctx.history() in later turns -------------------------------------------------


async def test_a_correction_in_turn_one_is_seen_by_turn_two(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "shop", "shop", AGENT))
    ada = EntityKey("shop", "ada")

    r1 = await env.runtime.invoke(env.principal, ada, "no, use the other supplier")
    first = json.loads(r1.reply)
    # This turn's own entries carry its id too.
    assert [(e["kind"], e["note"], e["turn_id"]) for e in first["history"]] == \
        [("correction", "use the other supplier", first["turn"])]

    r2 = await env.runtime.invoke(env.principal, ada, "fail")
    second = json.loads(r2.reply)
    assert second["turn"] != first["turn"]
    kinds = [(e["kind"], e["turn_id"]) for e in second["history"]]
    # Turn 1's correction (written by turn 1), then this turn's failed step.
    assert kinds == [("correction", first["turn"]), ("step", second["turn"])]
    assert second["history"][0]["note"] == "use the other supplier" and second["history"][0]["at"] > 0
    assert "supplier API down" in second["history"][1]["error"]

    # Turn 3 sees both earlier turns' entries, each with the turn that wrote it.
    third = json.loads((await env.runtime.invoke(env.principal, ada, "hello")).reply)
    assert [(e["kind"], e["status"], e["turn_id"]) for e in third["history"]] == [
        ("correction", "correction", first["turn"]), ("step", "failed", second["turn"])]

    # Another user of the same agent sees none of it.
    bob = json.loads((await env.runtime.invoke(env.principal, EntityKey("shop", "bob"), "hello")).reply)
    assert bob["history"] == []

    # Forgetting ada removes her log: her next turn starts with none.
    await env.runtime.forget(env.principal, "shop", "ada")
    ts = env.store.tenant(env.principal)
    assert _user_log(ts, "shop", "ada") == []
    again = json.loads((await env.runtime.invoke(env.principal, ada, "hello")).reply)
    assert again["history"] == []


# -- the built-in loop: the user's corrections ride in the user turn --------------------------------------


def _reply(text: str) -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                        "model": MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}})


async def test_builtin_loop_gives_the_model_the_users_corrections(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", llm_provider="openai",
                     llm_base_url=f"{wire.url}/v1", llm_api_key="sk-test", llm_model=MODEL)
        agent = tmp_path / "helper"
        agent.mkdir()
        (agent / "moorage.toml").write_text(
            '[agent]\nname = "helper"\nsystem_prompt = "You help."\n[agent.lifecycle]\nusers = "auto"\n')
        host = Host.open(cfg)
        await host.start()
        try:
            _, key = host.store.operator.create_tenant("acme")
            principal = host.store.authenticate(key.secret)
            await host.runtime.deploy(principal, agent)
            wire.script.push(_reply("Booked the train."), _reply("Booked the bus."), _reply("Hi."))
            r1 = await host.runtime.invoke(principal, EntityKey("helper", "ada"), "Book me a trip to Bergen.")
            assert r1.reply == "Booked the train."
            # The user corrects the finished turn (an outside correction, kept in the user's log).
            DurableEngine(host.store.tenant(principal)).correct(r1.run_id, "I never take trains")
            r2 = await host.runtime.invoke(principal, EntityKey("helper", "ada"), "And back home?")
            assert r2.reply == "Booked the bus."
            await host.runtime.invoke(principal, EntityKey("helper", "bob"), "Book me a trip to Bergen.")

            first, second, bobs = (q["body"]["messages"] for q in wire.script.requests)
            assert not any("corrections from the user" in str(m["content"]) for m in first)
            # In the new user turn, never in the stable prefix: the system message is the same byte for byte.
            assert second[-1]["role"] == "user"
            assert "[corrections from the user: I never take trains]" in second[-1]["content"]
            assert second[-1]["content"].endswith("And back home?")
            assert second[0] == first[0] and "corrections" not in second[0]["content"]
            assert not any("corrections from the user" in str(m["content"]) for m in bobs)
        finally:
            await stop_all_sandboxes(host.driver)
            await host.close()
