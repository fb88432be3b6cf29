"""Checkpoints through the Python SDK (async and sync) and the `moorage checkpoints` commands, over a real server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from moorage import AsyncClient, Client
from tests.api.conftest import acme, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

ROOT = Path(__file__).resolve().parents[2]


async def test_checkpoints_through_the_sdk_and_the_cli(live_rt, acme: str, tmp_path: Path) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("tt", tt_archive(tmp_path))
        for i in (1, 2):
            await sdk.invoke("tt", f"turn {i}", user="ada")
        listing = await sdk.list_checkpoints("tt", "ada")
        first = listing["data"][-1]["id"]
        named = await sdk.take_checkpoint("tt", "ada", name="mine")
        assert named["name"] == "mine"

    env = {**os.environ, "MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": acme,
           "MOORAGE_DATA_DIR": str(tmp_path / "cli"), "MOORAGE_LOG_LEVEL": "warning", "COLUMNS": "300"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        # The console script (as installed): `python -m moorage.cli.main` would load the CLI module twice.
        return subprocess.run([str(Path(sys.executable).parent / "moorage"), "checkpoints", *args], env=env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)

    shown = await asyncio.to_thread(cli, "list", "tt", "ada", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [c["id"] for c in json.loads(shown.stdout)["data"]][-1] == first
    table = await asyncio.to_thread(cli, "list", "tt", "ada")
    assert "'turn 2'" in table.stdout and "side-2" in table.stdout, table.stdout
    rolled = await asyncio.to_thread(cli, "rollback", "tt", "ada", first)
    assert rolled.returncode == 0 and f"rolled back to {first}" in rolled.stdout, rolled.stderr
    forked = await asyncio.to_thread(cli, "fork", "tt", "ada", first, "--to", "bea", "--json")
    assert forked.returncode == 0, forked.stderr
    assert [f["user"] for f in json.loads(forked.stdout)["forks"]] == ["bea"]
    missing = await asyncio.to_thread(cli, "rollback", "tt", "ada", "nope")
    assert missing.returncode != 0 and "404" in missing.stderr and "Traceback" not in missing.stderr

    def sync() -> None:
        with Client(live_rt.url, acme) as sdk:
            assert json.loads(sdk.invoke("tt", "ls", user="bea")["reply"]).keys() == {"1.txt"}
            out = sdk.fork_checkpoint("tt", "ada", first, ["cy", "dee"])
            assert [f["user"] for f in out["forks"]] == ["cy", "dee"]
            back = sdk.rollback_checkpoint("tt", "ada", named["id"])
            assert back["rolled_back_to"] == named["id"]
            assert json.loads(sdk.invoke("tt", "ls", user="ada")["reply"]).keys() == {"1.txt", "2.txt"}

    await asyncio.to_thread(sync)
