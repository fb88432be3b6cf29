"""What a turn that did not end with its reply is billed, as docs/api.md ("Billing from the usage figures") says: a
cancelled turn, and one stopped at its agent's `turn_timeout_s`. Through `moorage up` (process driver) and a model
server whose token counts the test sets: the tokens of its model calls that finished, and its awake period, once;
a guest the host stopped at the timeout is not billed awake while it is stopped."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from moorage import Client
from moorage.client import ApiError
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app
from tests.usage.test_billing_exact import sandbox_of, start

AGENT = '''
import asyncio
import time


async def ask(ctx, message):
    return await ctx.llm.complete([{"role": "user", "content": message}], max_tokens=8)


async def on_message(ctx, message):
    if message == "ping":
        return "pong"
    if message == "resumed":
        planned = await ctx.step("plan", lambda: ask(ctx, "plan"))  # journaled: not asked again when resumed
        await asyncio.sleep(1.0)
        drafted = await ask(ctx, "draft")  # asked again when resumed
        if drafted["text"] == "hang":
            await asyncio.sleep(600)  # the host dies here
        return planned["text"] + " " + drafted["text"]
    said = await ask(ctx, message)
    if message == "block":
        time.sleep(600)  # blocks the guest's event loop: the timed-out turn's guest is stopped
    await asyncio.sleep(600)  # cancelled, or stopped at turn_timeout_s, here
    return said["text"]
'''


def reply(text: str = "ok") -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                        "model": MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}})


def deploy(sdk: Client, base: Path, limits: str = "") -> None:
    root = base / "agent-slow"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "slow"\nentry = "agent.py"\n'
                                       f'[agent.lifecycle]\nusers = "auto"\n{limits}')
    (root / "agent.py").write_text(AGENT)
    sdk.deploy("slow", root)


def until(what: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.time() + timeout_s
    while not (got := what()):
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)
    return got


@pytest.fixture
def wire() -> Iterator[WireServer]:
    with WireServer(openai_app, "sk-test") as w:
        yield w


def totals(sdk: Client) -> dict[str, float]:
    return sdk.usage(agent="slow", user="ada")["totals"]


def test_a_cancelled_turn_counts_its_finished_model_call_and_its_awake_time(wire: WireServer, tmp_path: Path) -> None:
    wire.script.push(reply(), reply())
    host = start(wire, tmp_path / "data")
    try:
        with Client(host.url, host.key) as sdk:
            deploy(sdk, tmp_path)
            asked = time.time()
            run = sdk.invoke_async("slow", "hello", user="ada")
            until(lambda: totals(sdk).get("input_tokens"))  # its model call finished; the turn goes on
            awake = time.time()
            sdk.cancel(run["id"])
            done = until(lambda: (e := sdk.get_execution(run["id"]))["status"] != "running" and e)
            assert done["status"] == "cancelled", done
            assert len(wire.script.requests) == 1
            got = totals(sdk)
            assert (got["input_tokens"], got["output_tokens"]) == (100, 7), got
            assert "compute_seconds" not in got  # still awake: billed when the period ends
            time.sleep(0.5)
            asleep = time.time()
            sdk.sandbox_action(sandbox_of(sdk, "slow", "ada")["id"], "sleep")
            slept = time.time()
            billed = totals(sdk)["compute_seconds"]
            # From its wake (before the model call finished) to the sleep: the cancelled turn's time is in it.
            assert asleep - awake <= billed <= slept - asked, (billed, asleep - awake, slept - asked)
            assert sdk.usage()["totals"]["input_tokens"] == 100
    finally:
        host.stop()


def test_a_timed_out_turn_counts_its_finished_model_call_and_its_awake_time(wire: WireServer, tmp_path: Path) -> None:
    wire.script.push(*[reply() for _ in range(3)])
    host = start(wire, tmp_path / "data")
    try:
        with Client(host.url, host.key) as sdk:
            deploy(sdk, tmp_path, "[agent.limits]\nturn_timeout_s = 1\n")
            asked = time.time()
            with pytest.raises(ApiError) as e:
                sdk.invoke("slow", "hello", user="ada")
            answered = time.time()
            assert e.value.status == 504 and e.value.code == "turn-timeout", e.value
            got = totals(sdk)
            assert (got["input_tokens"], got["output_tokens"]) == (100, 7), got
            assert "compute_seconds" not in got  # the instance is still awake (the turn was cancelled in it)
            sdk.sandbox_action(sandbox_of(sdk, "slow", "ada")["id"], "sleep")
            slept = time.time()
            first = totals(sdk)["compute_seconds"]
            assert 1.0 <= first <= slept - asked, (first, slept - asked)

            # A turn whose code blocks its guest is stopped with its guest: that ends its awake period, billed then.
            asked = time.time()
            with pytest.raises(ApiError) as e:
                sdk.invoke("slow", "block", user="ada")
            answered = time.time()
            assert e.value.status == 504, e.value
            got = until(lambda: (t := totals(sdk)).get("compute_seconds", 0.0) > first and t, timeout_s=15)
            assert (got["input_tokens"], got["output_tokens"]) == (200, 14), got
            stopped = got["compute_seconds"] - first
            assert 1.0 <= stopped <= answered - asked + 1.0, (stopped, answered - asked)
            assert sandbox_of(sdk, "slow", "ada")["state"] == "sleeping"
            time.sleep(2.0)  # the seconds it is stopped are not awake seconds, nor counted by its compute cap
            assert totals(sdk) == got
            assert sdk.invoke("slow", "ping", user="ada")["reply"] == "pong"  # its next turn starts it from its disk
            assert len(wire.script.requests) == 2
            assert sdk.usage()["totals"] == sdk.usage(agent="slow")["totals"] == totals(sdk)
    finally:
        host.stop()

