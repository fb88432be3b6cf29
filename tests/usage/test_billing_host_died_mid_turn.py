"""A turn whose host died mid-turn runs again from the top when a host starts (docs/api.md, "Billing from the usage
figures"): the model call its journaled step made is not made again, the other is, and every call that finished is
billed, as the provider charged it. The dead host's awake period is billed up to its last finished model call, once:
it was billed up to the turn's start only, the turn's own awake time lost."""

from __future__ import annotations

import time
from pathlib import Path

from moorage import Client
from tests.llm.wire_servers import WireServer, openai_app
from tests.usage.test_billing_ended_turns import deploy, reply, start, totals, until
from tests.usage.test_billing_exact import sandbox_of


def test_a_turn_run_again_after_its_host_died_counts_the_model_calls_of_both_runs(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        run_and_kill(wire, tmp_path)


def run_and_kill(wire: WireServer, tmp_path: Path) -> None:
    wire.script.push(reply("planned"), reply("hang"), reply("drafted"))
    host = start(wire, tmp_path / "data")
    try:
        with Client(host.url, host.key) as sdk:
            deploy(sdk, tmp_path)
            asked = time.time()
            run = sdk.invoke_async("slow", "resumed", user="ada")
            until(lambda: totals(sdk).get("input_tokens") == 200)  # both calls finished (a second apart)
        host.kill()  # mid-turn
        down = time.time()
        time.sleep(2.0)
        up = time.time()  # the turn runs again as the host starts
        host = start(wire, tmp_path / "data")
        with Client(host.url, host.key) as sdk:
            done = until(lambda: (e := sdk.get_execution(run["id"]))["status"] not in ("queued", "running") and e,
                         timeout_s=120)
            assert done["status"] == "succeeded" and done["reply"] == "planned drafted", done
            # The journaled step's call was not made again, the other was: three calls, all three counted.
            assert [r["body"]["messages"][-1]["content"] for r in wire.script.requests] == ["plan", "draft", "draft"]
            got = totals(sdk)
            assert (got["input_tokens"], got["output_tokens"]) == (300, 21), got
            # The dead host's period, billed as the host started: from its wake to its last finished model call at
            # least (its step's call, then a second later the other), not the seconds the host was down.
            dead = got["compute_seconds"]
            assert 1.0 <= dead <= down - asked, (dead, down - asked)
            sdk.sandbox_action(sandbox_of(sdk, "slow", "ada")["id"], "sleep")
            slept = time.time()
            billed = totals(sdk)["compute_seconds"]
            # Both awake periods, each once: not the seconds the host was down.
            assert dead + 1.0 <= billed <= (down - asked) + (slept - up) + 1.0, (billed, down - asked, slept - up)
            assert sdk.usage()["totals"] == totals(sdk)
    finally:
        host.stop()
