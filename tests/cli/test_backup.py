"""`moorage backup DEST` (docs/operations.md) of a stopped host: refused while instances are recorded awake (a killed
host), otherwise a copy that a host started elsewhere serves from. While `moorage up` runs, the host takes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from moorage.client.sync import Client
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]
AGENT_PY = '''
async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def backup(data: Path, dest: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_SANDBOX_DRIVER": "process"}
    return subprocess.run([sys.executable, "-m", "moorage.cli.main", "backup", str(dest), *extra], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_backup_copies_a_stopped_host_and_refuses_a_crashed_one(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a" / "data", tmp_path / "b", tmp_path / "c"
    agent = tmp_path / "agents" / "echo"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    env = {"MOORAGE_LOG_LEVEL": "warning"}
    host = LocalHost("box", a, env, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", agent)
            assert sdk.invoke("echo", "one", user="ada")["reply"] == "1: one"
        # While the host runs it takes the copy itself (tests/cli/test_online_backup.py); stopped, it is cp -a.
        r = backup(a, b)
        assert r.returncode == 0 and "(online: 1 instance(s)" in r.stdout, r.stdout + r.stderr
        shutil.rmtree(b)
    finally:
        host.stop()
    r = backup(a, b)
    assert r.returncode == 0 and f"backed up {a} to {b}" in r.stdout, r.stdout + r.stderr
    assert "already exists" in backup(a, b).stderr

    # The host killed (a crash) while ada is awake: her instance is recorded running, its memory nowhere.
    host = LocalHost("box", a, env, start_timeout_s=120)
    with Client(host.url, host.key) as sdk:
        assert sdk.invoke("echo", "two", user="ada")["reply"] == "2: two"
    host.kill()
    r = backup(a, c)
    assert r.returncode == 2 and "1 instance(s) recorded awake" in r.stderr and "user:echo/ada" in r.stderr, r.stderr
    assert not c.exists()
    assert backup(a, c, "--force").returncode == 0

    # The backup, taken after the first turn, serves from where it was on another machine (the original gone).
    shutil.move(str(a.parent), str(tmp_path / "gone"))
    restored = LocalHost("elsewhere", b, env, start_timeout_s=120)
    try:
        with Client(restored.url, restored.key) as sdk:
            assert sdk.invoke("echo", "again", user="ada")["reply"] == "2: again"
    finally:
        restored.stop()
