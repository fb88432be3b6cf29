"""``moorage checkpoints list`` took ``--limit`` only: the API pages a user's checkpoints (``cursor``, ``next_cursor``)
but the CLI could show no page past the first, and nothing said there were more. It takes ``--cursor`` and
``--all`` (every page, as the other listings read them), and says on stderr where the next page starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost


def test_checkpoints_list_pages_like_the_api(tmp_path: Path) -> None:
    agent = tmp_path / "diary"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "diary"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text("async def on_message(ctx, message):\n    return 'noted ' + message\n")
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    env = {**os.environ, "MOORAGE_DATA_DIR": str(host.data), "MOORAGE_PORT": str(host.port)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moorage.cli.main", "checkpoints", "list", *args], env=env,
                              capture_output=True, text=True, timeout=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("diary", agent)
            for n in range(6):
                sdk.invoke("diary", f"day {n}", user="ada")  # a checkpoint after each turn
            whole = [c["id"] for c in sdk.list_checkpoints("diary", "ada", limit=500)["data"]]
        assert len(whole) >= 6
        first = cli("diary", "ada", "--limit", "3", "--json")
        page = json.loads(first.stdout)
        assert [c["id"] for c in page["data"]] == whole[:3] and page["next_cursor"], first.stdout
        said = " ".join(first.stderr.split())
        assert f"moorage checkpoints list diary ada --cursor {page['next_cursor']}" in said and "--all" in said, said
        second = json.loads(cli("diary", "ada", "--limit", "3", "--cursor", page["next_cursor"], "--json").stdout)
        assert [c["id"] for c in second["data"]] == whole[3:6]
        every = cli("diary", "ada", "--limit", "3", "--all", "--json")
        out = json.loads(every.stdout)
        assert [c["id"] for c in out["data"]] == whole and out["next_cursor"] is None, every.stdout
        assert out["branches"] == page["branches"] and every.stderr == "", every.stderr
        table = cli("diary", "ada", "--limit", "2", "--all")
        assert table.returncode == 0 and all(f"'day {n}'" in table.stdout for n in range(6)), table.stdout
        too_many = cli("diary", "ada", "--limit", "501")
        assert too_many.returncode == 2 and "--limit" in too_many.stderr, too_many.stderr
    finally:
        host.stop()
