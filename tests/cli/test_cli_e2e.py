"""The CLI end to end against a real `moorage up` server process (process sandboxes, embedded model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.sandbox.process import ProcessDriver
from moorage.store import open_store
from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]
MOORAGE = [sys.executable, "-m", "moorage.cli.main"]


def _env(data: Path, port: int) -> dict[str, str]:
    return {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(port), "MOORAGE_SANDBOX_DRIVER": "process",
            "MOORAGE_LOG_LEVEL": "warning"}


def run(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MOORAGE, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_readme_main_command_runs_example_one_end_to_end(tmp_path: Path) -> None:
    """What `scripts/up.sh` runs: deploy examples/assistant and hold a two-session conversation, offline."""
    env = _env(tmp_path / "data", 0)
    r = run(["up", "--demo", "examples/assistant", "--exit-after-demo"], env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    assert "moorage is up at http://127.0.0.1:" in out and "127.0.0.1:0 " not in out  # the port it got, said
    assert "deployed assistant #1" in out
    friday = out.split("ada (friday)")[1]
    assert "green tea" in friday.lower()
    assert (tmp_path / "data" / "local-admin.key").stat().st_mode & 0o777 == 0o600
    # A process sandbox dies with its host, so the host put the demo's agent to sleep before it exited: the
    # store says so, and nothing of the sandbox (processes, cgroup) is left on this machine.
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")
    store = open_store(cfg)
    try:
        states = [r.state for ts in store.operator.tenants() for r in ts.sandboxes.list()]
    finally:
        store.close()
    assert states and set(states) == {"sleeping"}, states
    driver = ProcessDriver(cfg.sandboxes_dir, cfg)
    support = driver.limit_support
    parents = [p for p in (support.v2_dir, support.v1_pids, support.v1_memory) if p is not None]
    assert not [c for p in parents for c in p.glob(f"{driver.instance_tag}-*")]


def test_cli_client_commands_against_a_running_server(tmp_path: Path) -> None:
    env = _env(tmp_path / "data", 0)  # the CLI's commands find the port the kernel chose in moorage-up.json
    # --detach on a driver whose sandboxes end with the host: said once at start, and the stop sleeps them.
    server = subprocess.Popen([*MOORAGE, "up", "--detach"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(server, tmp_path / "data", output=lambda: server.stdout.read() if server.poll() is not None else "")
        # A second host on the same data directory would drive the same sandboxes: it does not start.
        second = run(["up", "--port", str(free_port())], env, timeout=120)
        assert second.returncode == 2 and f"in use by another moorage host (pid {server.pid})" in " ".join(
            second.stderr.split()), second.stderr
        d = run(["deploy", "examples/coder"], env)
        assert d.returncode == 0 and "deployed coder #1" in d.stdout, d.stdout + d.stderr
        # The build's steps as it went, on stderr (stdout holds the result alone).
        steps = d.stderr.splitlines()
        assert steps[0].startswith("coder: starting a sandbox for the template") and "coder: template ready" in steps, \
            d.stderr
        assert d.stdout.strip().splitlines() == ["deployed coder #1 (" + d.stdout.split("(")[1].split(")")[0] + ")"]
        assert run(["invoke", "coder", "install", "-u", "dev"], env).stdout.strip() == "installed slugkit"
        assert run(["invoke", "coder", "write", "-u", "dev"], env).stdout.strip() == "wrote projects/slug.py"
        boxes = json.loads(run(["ps", "--json"], env).stdout)["data"]
        assert [b["state"] for b in boxes] == ["running"]
        slept = run(["sleep", boxes[0]["id"]], env)
        assert json.loads(slept.stdout)["slept"] is True, slept.stdout + slept.stderr
        assert json.loads(run(["ps", "--json"], env).stdout)["data"][0]["state"] == "sleeping"
        r = run(["invoke", "coder", "run Hello CLI", "-u", "dev", "-s", "later"], env)
        assert r.stdout.strip() == "hello-cli", r.stdout + r.stderr
        bad = run(["invoke", "ghost", "hi", "-u", "dev"], env)
        assert bad.returncode != 0 and "ghost" in bad.stderr and "Traceback" not in bad.stderr
        # The README's `moorage fork SANDBOX_ID --to NEW_USER`: dev2 starts as dev is now (the package installed).
        forked = run(["fork", boxes[0]["id"], "--to", "dev2"], env)
        assert [f["user"] for f in json.loads(forked.stdout)["forks"]] == ["dev2"], forked.stdout + forked.stderr
        r = run(["invoke", "coder", "run Hello Fork", "-u", "dev2"], env)
        assert r.stdout.strip() == "hello-fork", r.stdout + r.stderr
        for user in ("dev", "dev2"):
            f = run(["forget", "coder", user, "--yes"], env)
            assert f.returncode == 0, f.stderr
        assert json.loads(run(["ps", "--json"], env).stdout)["data"] == []
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    said = " ".join((server.stdout.read() if server.stdout else "").split())  # as printed, wrapped at 80 columns
    assert "--detach has no effect here: process sandboxes end with the host" in said, said
    assert "putting awake instances to sleep (process sandboxes end with the host" in said, said
    assert "leaving instances running" not in said, said
