"""The CLI's end-user and execution commands (they go through the Python SDK) against a real `moorage up`."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from tests.cli.test_cli_e2e import MOORAGE, ROOT, _env, run
from tests.upproc import wait_serving


def test_users_and_executions_from_the_cli(tmp_path: Path) -> None:
    env = _env(tmp_path / "data", 0)
    server = subprocess.Popen([*MOORAGE, "up"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        wait_serving(server, tmp_path / "data", output=lambda: server.stdout.read() if server.poll() is not None else "")
        assert run(["deploy", "examples/coder"], env).returncode == 0
        made = run(["user", "coder", "cust-1", "--meta", "plan=pro"], env)
        assert made.returncode == 0 and json.loads(made.stdout)["metadata"] == {"plan": "pro"}, made.stderr
        assert json.loads(run(["user", "coder", "cust-1"], env).stdout)["metadata"] == {"plan": "pro"}  # get, not reset
        listed = json.loads(run(["users", "coder", "--json", "--meta", "plan=pro"], env).stdout)["data"]
        assert [u["id"] for u in listed] == ["cust-1"]
        done = run(["submit", "coder", "install", "-u", "cust-1", "--wait"], env)
        assert done.returncode == 0 and "succeeded" in done.stdout and "installed slugkit" in done.stdout, done.stderr
        ex_id = done.stdout.split()[1].rstrip(":")
        shown = json.loads(run(["execution", ex_id, "--json"], env).stdout)
        assert shown["status"] == "succeeded" and shown["user"] == "cust-1"
        missing = run(["execution", "nope"], env)
        assert missing.returncode != 0 and "404" in missing.stderr and "Traceback" not in missing.stderr

        # A turn whose agent raises: the reason shown and a failing exit status, for scripts.
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "moorage.toml").write_text('[agent]\nname = "broken"\nentry = "agent.py"\n'
                                             '[agent.lifecycle]\nusers = "auto"\n')
        (broken / "agent.py").write_text("async def on_message(ctx, message):\n    raise ValueError('no [cash] left')\n")
        assert run(["deploy", str(broken)], env).returncode == 0
        failed = run(["submit", "broken", "pay", "-u", "cust-1", "--wait"], env)
        assert failed.returncode == 1 and "failed — " in failed.stdout and "no [cash] left" in failed.stdout, failed
        again = run(["execution", failed.stdout.split()[1].rstrip(":")], env)
        assert again.returncode == 1 and "no [cash] left" in again.stdout
        # An error's text reaches the terminal as written (brackets are not console markup).
        sync = run(["invoke", "broken", "pay", "-u", "cust-1"], env)
        assert sync.returncode != 0 and "no [cash] left" in sync.stderr and "Traceback" not in sync.stderr, sync

        # A workflow that asks twice: each question printed as JSON with how to answer it; a reply's trace id is
        # on stderr (stdout stays the reply) and whole in `moorage logs`, so `moorage trace` finds it.
        asks = tmp_path / "asks"
        asks.mkdir()
        (asks / "moorage.toml").write_text('[agent]\nname = "asks"\nentry = "agent.py"\n'
                                           '[agent.lifecycle]\nusers = "auto"\n')
        (asks / "agent.py").write_text("async def on_message(ctx, message):\n"
                                       "    a = await ctx.interrupt({'q': 'first?'})\n"
                                       "    b = await ctx.interrupt({'q': 'second?'})\n"
                                       "    return a + b\n")
        assert run(["deploy", str(asks)], env).returncode == 0
        first = run(["invoke", "asks", "go", "-u", "cust-1"], env)
        assert '{"q": "first?"}' in first.stdout and "answer with: moorage answer" in first.stdout, first
        run_id = first.stdout.split("answer with: moorage answer ")[1].split()[0]
        second = run(["answer", run_id, "A"], env)
        assert '{"q": "second?"}' in second.stdout and f"moorage answer {run_id}" in second.stdout, second
        done = run(["answer", run_id, "B"], env)
        assert done.stdout.strip() == "AB" and done.stderr.startswith("trace "), done
        trace_id = done.stderr.split()[1]
        assert trace_id in run(["logs", "--limit", "500"], env).stdout
        assert run(["trace", trace_id], env).returncode == 0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
