"""The README's "Using it" commands, run by a shell as written, in order, against `moorage up` (the `up` lines are
the host this test starts): only the placeholders are filled in, from what the commands before them printed
(SANDBOX_ID from `moorage ps`, TRACE_ID from the trace line a turn prints, RUN_ID from a turn waiting for approval),
and the chat's typed lines given on its stdin."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.fleet import LocalHost
from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
MOORAGE = f"{sys.executable} -m moorage.cli.main"
ASKS = "async def on_message(ctx, message):\n    return 'shipped: ' + await ctx.interrupt({'question': 'ship it?'})\n"


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text().split("## Using it", 1)[1]
    block = next(body for lang, body in fenced_blocks(text) if lang == "bash")
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith(".venv/bin/moorage ")]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    server = LocalHost("up", tmp_path_factory.mktemp("using-it") / "data", {"MOORAGE_LOG_LEVEL": "warning"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_the_readmes_commands_as_written(host: LocalHost, tmp_path: Path) -> None:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(host.data), "MOORAGE_PORT": str(host.port)}

    def sh(command: str, typed: str = "") -> subprocess.CompletedProcess[str]:
        r = subprocess.run(command.replace(".venv/bin/moorage", MOORAGE), shell=True, env=env, cwd=ROOT, input=typed,
                           capture_output=True, text=True, timeout=600)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    commands = _commands()
    said = [" ".join(c.split()[1:3]) if c.split()[1:3] == ["agents", "delete"] else c.split()[1] for c in commands]
    assert said == ["up", "up", "up", "deploy", "agents", "invoke", "submit", "chat", "ps", "sleep", "answer", "forget",
                    "agents delete", "trace", "doctor"], said
    # What the README's lines take for granted: examples/assistant deployed (scripts/up.sh does), and some turn
    # waiting for approval for `answer RUN_ID yes`.
    asks = tmp_path / "asks"
    asks.mkdir()
    (asks / "moorage.toml").write_text('[agent]\nname = "asks"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (asks / "agent.py").write_text(ASKS)
    for folder in ("examples/assistant", str(asks)):
        assert sh(f".venv/bin/moorage deploy {folder}").returncode == 0
    waiting = sh(".venv/bin/moorage invoke asks 'new release' -u ada")
    run_id = re.search(r"waiting for approval \(workflow (\w+)\)", waiting.stdout + waiting.stderr).group(1)

    out: dict[str, subprocess.CompletedProcess[str]] = {}
    for command, verb in zip(commands, said):
        if verb == "up":
            continue  # the host this test runs
        if verb == "sleep":
            listed = json.loads(sh(".venv/bin/moorage ps --json").stdout)["data"]
            command = command.replace("SANDBOX_ID", next(i["id"] for i in listed if i["scope"] == "user:coder/dev"))
        command = command.replace("RUN_ID", run_id)
        if verb == "trace":
            # Not coder/dev's turn: `forget coder dev --yes` just erased its traces with the rest of that user.
            command = command.replace("TRACE_ID", re.search(r"trace (\w+)", out["answer"].stderr).group(1))
        r = out[verb] = sh(command, typed="Hi, I am Ada.\n\n" if verb == "chat" else "")
        assert r.returncode == (r.returncode if verb == "doctor" else 0), (command, r.stdout + r.stderr)

    assert "deployed coder" in out["deploy"].stdout
    assert re.search(r"coder\s.*#1", out["agents"].stdout), out["agents"].stdout
    assert out["invoke"].stdout.strip() == "installed slugkit"
    assert re.match(r"execution \w+: succeeded — installed slugkit", out["submit"].stdout), out["submit"].stdout
    assert "chatting with assistant as ada" in out["chat"].stdout and "assistant ›" in out["chat"].stdout
    assert "user:coder/dev" in out["ps"].stdout
    assert json.loads(out["sleep"].stdout)["slept"] is True
    assert out["answer"].stdout.strip() == "shipped: yes"
    assert re.match(r"forgot dev: \d+ records removed", out["forget"].stdout), out["forget"].stdout
    assert re.match(r"deleted agent coder \(users forgotten: 0, records removed: \d+\)", out["agents delete"].stdout), \
        out["agents delete"].stdout  # 0: `forget coder dev` went first
    assert "POST /v1/workflows/{run_id}/answer" in out["trace"].stdout, out["trace"].stdout
    # QEMU, KVM, bubblewrap, disk, store: each checked (exit 1 where a required one fails, as docs/cli.md says).
    assert out["doctor"].returncode in (0, 1)
    assert [line.split()[1] for line in out["doctor"].stdout.splitlines() if line[:4] in ("ok  ", "warn", "FAIL")] == [
        "qemu", "kvm", "bubblewrap", "disk", "store"], out["doctor"].stdout
