"""examples/researcher/README.md's "Run it", command by command, as written: `moorage up` with the environment it
names, its stand-in search API (on a free port instead of 8003), then each `moorage` line through a shell, with the
RUN_ID the research turn printed. What each prints is what the README's comments say."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from moorage.devservices.fleet import LocalHost
from moorage.devservices.postgres import free_port
from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "examples" / "researcher" / "README.md"


def _steps() -> tuple[dict[str, str], str, list[tuple[str, str]]]:
    """The environment of `moorage up`, the stand-in API's code, and each later command with its comment."""
    block = next(body for lang, body in fenced_blocks(README.read_text()) if lang == "bash")
    up, rest = block.split("\n", 1)
    words = shlex.split(up.split("#")[0].strip().rstrip("&"))
    assert words[-2:] == [".venv/bin/moorage", "up"], up
    api, rest = rest.split("\nEOF\n", 1)
    assert api.startswith("python3 - <<'EOF' &"), api
    commands: list[tuple[str, str]] = []
    for line in rest.splitlines():
        if line.startswith("#"):  # what the command before prints
            commands[-1] = (commands[-1][0], commands[-1][1] + line.lstrip("# ").strip())
        elif line.strip():
            commands.append((line.split("   #")[0].strip(), ""))  # its comment on the line says what it is for
    return dict(w.split("=", 1) for w in words[:-2]), api.split("\n", 1)[1], commands


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalHost, int]]:
    env, api, _ = _steps()
    port = free_port()
    stand_in = subprocess.Popen([sys.executable, "-c", api.replace("8003", str(port))])
    host = LocalHost("up", tmp_path_factory.mktemp("researcher-readme") / "data",
                     {**env, "MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        yield host, port
    finally:
        host.stop()
        stand_in.terminate()
        stand_in.wait(timeout=30)


def test_the_readme_runs_as_written(running: tuple[LocalHost, int]) -> None:
    host, port = running
    _, _, commands = _steps()
    env = {**os.environ, "MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key}
    run_id, outputs = "", []
    for cmd, said in commands:
        line = cmd.replace("8003", str(port)).replace("RUN_ID", run_id)
        p = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (line, p.stdout, p.stderr)
        out = p.stdout + p.stderr
        outputs.append(out)
        found = re.search(r"workflow ([0-9a-f]{16,})", out)
        if found:
            run_id = found.group(1)
            assert said.startswith("waiting for approval (workflow RUN_ID): ") and "solar storms" in out, (said, out)
        elif said:
            assert said in out, (line, said, out)
    assert run_id and len(commands) >= 7, commands
    answered = next(i for i, (cmd, _) in enumerate(commands) if cmd.startswith(".venv/bin/moorage answer RUN_ID yes"))
    assert "wrote solar-storms.md" in outputs[answered] and "wrote solar-storms.md" in README.read_text(), outputs
    assert '"watcher": "started"' in outputs[-1] and "Oslo" in outputs[-2], outputs[-2:]
