"""examples/researcher on the micro-VM driver: the watcher its `watch` command starts with ctx.spawn keeps running
across a sleep and a wake (the VM's processes and memory are its sleeping state), where the process driver has to
start it again (tests/examples/test_researcher.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost

AGENT = Path(__file__).resolve().parents[2] / "examples" / "researcher"


@pytest.mark.slow
def test_the_watcher_is_still_running_after_the_vm_slept_and_woke(tmp_path: Path) -> None:
    images = os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")
    host = LocalHost("vm", tmp_path / "data", {"MOORAGE_TEST_IMAGES_DIR": images, "MOORAGE_LOG_LEVEL": "warning"},
                     driver="microvm")
    try:
        with Client(host.url, host.key, timeout_s=600) as sdk:
            sdk.deploy("researcher", AGENT)

            def watch() -> dict:
                return json.loads(sdk.invoke("researcher", "watch", user="ada")["reply"])

            started = watch()
            assert started["watcher"] == "started", started
            time.sleep(2)
            before = watch()
            assert before["watcher"] == "running" and before["pid"] == started["pid"], before
            sid = sdk.get_user("researcher", "ada")["instance"]["sandbox_id"]
            sdk.sandbox_action(sid, "sleep")
            assert sdk.get_sandbox(sid)["state"] == "sleeping"
            sdk.sandbox_action(sid, "wake")
            time.sleep(2)
            after = watch()
            assert after["watcher"] == "running" and after["pid"] == started["pid"], after
            assert after["ticks"] > before["ticks"], (before, after)  # it went on ticking after the wake
    finally:
        host.stop()
