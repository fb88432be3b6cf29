"""A webhook whose receiver is on the host's own network (a backend on 127.0.0.1 while developing) is refused by the
host's egress on every attempt; the attempt's error, which is all a backend sees of it, says which setting admits it."""

from __future__ import annotations

import time
from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]


def test_a_refused_delivery_says_which_setting_admits_the_receiver(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("notes", ROOT / "examples" / "backend" / "agent")
            sdk.put_user("notes", "ada")
            hook = sdk.create_webhook("notes", "http://127.0.0.1:9/hooks/moorage", events=["execution.succeeded"])
            sdk.wait_execution(sdk.invoke_async("notes", "hi", user="ada")["id"], timeout_s=60)
            deadline = time.time() + 30
            while not (deliveries := sdk.list_deliveries("notes", hook["id"])["data"]) or not deliveries[0]["attempts"]:
                assert time.time() < deadline, "no attempt was made"
                time.sleep(0.2)
            (attempt,) = sdk.get_delivery("notes", hook["id"], deliveries[0]["id"])["attempt_log"]
    finally:
        host.stop()
    assert attempt["error"].startswith("egress-denied: egress to http://127.0.0.1:9 refused: it resolves to a "
                                       "loopback address"), attempt
    assert "MOORAGE_EGRESS_ALLOW_CIDRS=127.0.0.0/8" in attempt["error"] and "docs/egress.md" in attempt["error"], attempt
