"""docs/cli.md: a listing's `data` is the whole list unless the command shows one page. `moorage ps` showed the 200
most recently active instances of `GET /v1/fleet` and nothing said there were more (nor did `--state` look past
them). It now takes `--limit` (up to 500) and says on stderr when instances were left out; `counts` has them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost, write_counter_agent


def test_ps_says_when_it_shows_only_some_instances(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    env = {**os.environ, "MOORAGE_DATA_DIR": str(host.data), "MOORAGE_PORT": str(host.port)}

    def ps(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moorage.cli.main", "ps", *args], env=env, capture_output=True,
                              text=True, timeout=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", write_counter_agent(tmp_path))
            for user in ("ann", "bob", "cy"):
                sdk.invoke("echo", "hi", user=user)
        every = ps("--json")
        assert every.returncode == 0 and every.stderr == "", every.stderr
        assert len(json.loads(every.stdout)["data"]) == 3
        some = ps("--limit", "2", "--json")
        shown = json.loads(some.stdout)
        assert [i["user"] for i in shown["data"]] == ["cy", "bob"] and sum(shown["counts"].values()) == 3
        assert "showing the 2 most recently active of 3 instances" in some.stderr, some.stderr
        too_many = ps("--limit", "501")
        assert too_many.returncode == 2 and "--limit" in too_many.stderr, too_many.stderr
    finally:
        host.stop()
