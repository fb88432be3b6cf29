"""A product bills its end-users from `GET /v1/usage`: the figures reconciled against what the test controls, through
`moorage up`, HTTP and the SDK. Awake seconds of an instance whose host died are billed once (they were lost: the
recovery put it to sleep without recording them, and the next wake stamped a new start)."""

from __future__ import annotations

import time
from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost
from moorage.store import Scope

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
        time.sleep(1.0)  # idle, then the machine dies with the instance awake
        host.kill()
        down = time.time()
        time.sleep(1.0)
        host = LocalHost("a", tmp_path / "data", env, start_timeout_s=120)
        with Client(host.url, host.key) as sdk:
            billed = sdk.usage(agent="echo", user="ada")["totals"].get("compute_seconds")
            # From its wake to its last turn: not the idle second before the death, nor the time the host was down.
            assert billed is not None and last - first - 0.3 <= billed <= down - first + 0.5, (billed, last - first)
            assert billed < last - first + 0.9, (billed, last - first)
            # Its next awake period is billed on its own: the first is not billed again.
            sdk.invoke("echo", "back", user="ada")
            woke = time.time()
            time.sleep(0.5)
            sdk.sandbox_action(sandbox_of(sdk, "echo", "ada")["id"], "sleep")
            slept = time.time()
            again = sdk.usage(agent="echo", user="ada")["totals"]["compute_seconds"]
            assert 0.4 <= again - billed <= slept - woke + 1.0, (billed, again)
            tenant = sdk.usage()["totals"]["compute_seconds"]
            assert tenant == again == sdk.usage(agent="echo")["totals"]["compute_seconds"]
    finally:
        host.stop()
