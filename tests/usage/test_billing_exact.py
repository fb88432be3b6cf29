"""A product bills its end-users from `GET /v1/usage`: the figures reconciled against what the test controls, through
`moorage up`, HTTP and the SDK. Awake seconds of an instance whose host died are billed once (they were lost: the
recovery put it to sleep without recording them, and the next wake stamped a new start)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from moorage import Client
from moorage.client import ApiError
from moorage.devservices.fleet import LocalHost
from moorage.store import Scope
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app

AGENT = '''
async def on_message(ctx, message):
    return "echo: " + message
'''


def write_agent(base: Path, name: str, body: str) -> Path:
    root = base / f"agent-{name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(body)
    return root


def sandbox_of(sdk: Client, agent: str, user: str) -> dict:
    boxes = [b for b in sdk.list_sandboxes(agent=agent)["data"] if b["scope"] == Scope.for_user(agent, user).key]
    assert len(boxes) == 1, boxes
    return boxes[0]


def test_awake_seconds_of_a_host_that_died_are_billed_once(tmp_path: Path) -> None:
    env = {"MOORAGE_LOG_LEVEL": "warning"}
    host = LocalHost("a", tmp_path / "data", env, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", write_agent(tmp_path, "echo", AGENT))
            sdk.invoke("echo", "wake up", user="ada")  # provisions the instance: its awake time starts here
            first = time.time()
            for i in range(3):
                time.sleep(0.5)
                sdk.invoke("echo", f"turn {i}", user="ada")
            last = time.time()
            assert "compute_seconds" not in sdk.usage(agent="echo", user="ada")["totals"]  # awake, not yet billed
        time.sleep(2.5)  # idle, then the machine dies with the instance awake
        host.kill()
        down = time.time()
        time.sleep(1.0)
        host = LocalHost("a", tmp_path / "data", env, start_timeout_s=120)
        with Client(host.url, host.key) as sdk:
            billed = sdk.usage(agent="echo", user="ada")["totals"].get("compute_seconds")
            # From its wake to its last turn: not the idle seconds before the death, nor the time the host was down.
            assert billed is not None and last - first - 1.0 <= billed < last - first + 2.0 < down - first, \
                (billed, last - first)
            # Its next awake period is billed on its own: the first is not billed again.
            sdk.invoke("echo", "back", user="ada")
            woke = time.time()
            time.sleep(0.5)
            sdk.sandbox_action(sandbox_of(sdk, "echo", "ada")["id"], "sleep")
            slept = time.time()
            again = sdk.usage(agent="echo", user="ada")["totals"]["compute_seconds"]
            assert 0.4 <= again - billed <= slept - woke + 2.0, (billed, again)
            tenant = sdk.usage()["totals"]["compute_seconds"]
            assert tenant == again == sdk.usage(agent="echo")["totals"]["compute_seconds"]
    finally:
        host.stop()


MODEL_AGENT = '''
async def on_message(ctx, message):
    out = await ctx.llm.complete([{"role": "user", "content": message}], max_tokens=8)
    if message == "fail":
        raise RuntimeError("the agent failed after its model call")
    return out["text"]
'''


def start(wire: WireServer, data: Path) -> LocalHost:
    """``moorage up`` whose model is ``wire`` (each call answered as the test scripts it)."""
    env = {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_LLM_PROVIDER": "openai", "MOORAGE_LLM_BASE_URL": f"{wire.url}/v1",
           "MOORAGE_LLM_API_KEY": "sk-test", "MOORAGE_LLM_MODEL": MODEL}
    return LocalHost("a", data, env, start_timeout_s=120)


def _reply() -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                        "model": MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}})


def test_tokens_reconcile_and_forgetting_a_user_leaves_invoiced_totals_as_they_were(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        wire.script.push(*[_reply() for _ in range(20)])
        host = start(wire, tmp_path / "data")
        try:
            with Client(host.url, host.key) as sdk:
                sdk.deploy("notes", write_agent(tmp_path, "notes", MODEL_AGENT))
                first = sdk.invoke("notes", "one", user="ada", idempotency_key="turn-1")
                again = sdk.invoke("notes", "one", user="ada", idempotency_key="turn-1")  # replayed: not counted
                assert again["usage"] == first["usage"] == {"input_tokens": 100, "output_tokens": 7}
                sdk.invoke("notes", "two", user="ada")
                with pytest.raises(ApiError):
                    sdk.invoke("notes", "fail", user="ada")  # its model call was made (and paid): it counts
                sdk.invoke("notes", "hi", user="bob")
                assert len(wire.script.requests) == 4  # the ground truth: four model calls of 100 in, 7 out
                for user in ("ada", "bob"):
                    sdk.sandbox_action(sandbox_of(sdk, "notes", user)["id"], "sleep")
                ada, bob = (sdk.usage(agent="notes", user=u)["totals"] for u in ("ada", "bob"))
                assert (ada["input_tokens"], ada["output_tokens"], bob["input_tokens"], bob["output_tokens"]) == \
                    (300, 21, 100, 7)
                invoice = sdk.usage(by_day=True)
                assert invoice["totals"]["input_tokens"] == 400 and invoice["totals"]["output_tokens"] == 28
                assert {"compute_seconds", "disk_bytes"} <= invoice["totals"].keys()
                for kind, amount in invoice["totals"].items():  # the tenant is the sum of its users, and of its days
                    assert amount == pytest.approx(ada.get(kind, 0.0) + bob.get(kind, 0.0)), kind
                    if kind not in ("disk_bytes", "snapshot_bytes"):  # levels: a day's, not a sum of days
                        assert amount == pytest.approx(sum(d["totals"].get(kind, 0.0) for d in invoice["days"])), kind
                assert sdk.usage(agent="notes")["totals"] == invoice["totals"]

                sdk.delete_user("notes", "ada")
                # The invoice already sent still adds up: the tenant's and the agent's totals do not change.
                after = sdk.usage(by_day=True)
                assert after["totals"] == invoice["totals"] and after["days"] == invoice["days"]
                assert sdk.usage(agent="notes")["totals"] == invoice["totals"]
                assert sdk.usage(agent="notes", user="ada")["totals"] == {}  # nothing is kept under her name
                assert sdk.usage(agent="notes", user="bob")["totals"] == bob
        finally:
            host.stop()
