"""Deleting a whole agent the documented ways, through `moorage up` (process driver): `moorage agents delete` (CLI)
and `Client.delete_agent` (SDK). Its users' instances leave the host's disk at once, its package and template at the
next collection; the tenant's storage no longer counts them; a turn in flight when the delete came is cancelled, not
left running for a user who is gone; the name is free again for a new agent that starts empty."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.client.errors import ApiError
from moorage.devservices.fleet import LocalHost
from tests.fleet.harness import until

SLOW = '''
import asyncio

async def on_message(ctx, message):
    if message == "slow":
        await asyncio.sleep(30)
    return "{v}: " + message
'''


def _agent(root: Path, v: str) -> Path:
    d = root / f"gone-{v}"
    d.mkdir(parents=True)
    (d / "moorage.toml").write_text('[agent]\nname = "gone"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (d / "agent.py").write_text(SLOW.replace("{v}", v))
    (d / "data.bin").write_bytes(os.urandom(100_000))  # its package: counted for the tenant until the agent goes
    return d


def test_an_agent_deleted_from_the_cli_and_the_sdk_leaves_the_host_and_its_name_is_free(tmp_path: Path) -> None:
    data = tmp_path / "data"
    host = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_TENANT_MAX_STORAGE_MIB": "64",
                                  "MOORAGE_TEMPLATE_GC_INTERVAL_S": "1", "MOORAGE_TEMPLATE_GC_GRACE_S": "1"},
                     start_timeout_s=120)
    cli_env = {"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key}

    def packages() -> set[str]:
        return {p.name.removesuffix(".tar.gz") for p in (data / "packages").glob("*.tar.gz")}

    try:
        with Client(host.url, host.key) as sdk:
            first = sdk.deploy("gone", _agent(tmp_path, "v0"))
            dep = sdk.deploy("gone", _agent(tmp_path, "v1"))
            for user in ("ada", "bob"):
                assert sdk.invoke("gone", "hi", user=user)["reply"] == "v1: hi"
            instances = {i["id"] for i in sdk.list_sandboxes()["data"]}
            assert len(instances) == 2 and all((data / "sandboxes" / i).is_dir() for i in instances)
            # Its packages count for the tenant (measured again 10 s after the last measure, RECHECK_S).
            until(lambda: sdk.usage()["storage"]["package_bytes"] > 200_000, "its packages counted", 30)

            # A slow turn of ada's is running when the delete comes: it is cancelled, and the delete goes on.
            slow: dict[str, Any] = {}

            def turn() -> None:
                with Client(host.url, host.key, max_retries=0) as other:
                    try:
                        slow["reply"] = other.invoke("gone", "slow", user="ada")
                    except ApiError as e:
                        slow["error"] = e

            runner = threading.Thread(target=turn)
            runner.start()
            time.sleep(1.0)
            asked = CliRunner().invoke(app, ["agents", "delete", "gone"], env=cli_env, input="n\n")
            assert asked.exit_code == 1 and sdk.get_agent("gone")["name"] == "gone", asked.output  # it asks first
            started = time.monotonic()
            done = CliRunner().invoke(app, ["agents", "delete", "gone", "--yes", "--json"], env=cli_env)
            assert done.exit_code == 0, done.output
            assert json.loads(done.stdout) == {**json.loads(done.stdout), "agent": "gone", "deleted": True, "users": 2}
            runner.join(timeout=30)
            assert time.monotonic() - started < 20 and "reply" not in slow, slow
            assert slow["error"].status == 409, slow

            # Gone for the SDK, the CLI and the disk; the tenant's storage no longer counts it.
            with pytest.raises(ApiError) as e:
                sdk.get_agent("gone")
            assert e.value.status == 404
            with pytest.raises(ApiError) as e:
                sdk.invoke("gone", "hi", user="ada")
            assert e.value.status == 404
            listed = CliRunner().invoke(app, ["agents", "--json"], env=cli_env)
            assert listed.exit_code == 0 and json.loads(listed.stdout)["data"] == [], listed.output
            assert not any((data / "sandboxes" / i).exists() for i in instances)
            assert sdk.list_sandboxes()["data"] == []
            assert sdk.usage()["storage"]["package_bytes"] == 0
            until(lambda: not {first["package_sha256"], dep["package_sha256"]} & packages(),
                   "its packages to leave the disk")

            # The name is free: a new agent, empty (no user, no memory of ada), numbered from 1.
            again = sdk.deploy("gone", _agent(tmp_path, "v2"))
            assert again["number"] == 1 and again["id"] != dep["id"]
            assert sdk.list_users("gone")["data"] == []
            assert sdk.invoke("gone", "hi", user="ada")["reply"] == "v2: hi"
            r = sdk.delete_agent("gone")
            assert r["agent"] == "gone" and r["deleted"] is True and r["users"] == 1 and r["removed"] > 0, r
    finally:
        host.stop()
