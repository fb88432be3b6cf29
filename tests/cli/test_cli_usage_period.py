"""`moorage usage --since/--until/--user`: an operator reconciling an invoice from the terminal reads one period,
`[since, until)`, or one end-user, against a real `moorage up` and a model server whose token counts the test sets.
Before, the command read the tenant's (or one agent's) usage of all time only."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from click.testing import Result
from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.devservices.fleet import LocalHost
from tests.llm.wire_servers import WireServer, openai_app
from tests.usage.test_billing_exact import MODEL_AGENT, _reply, write_agent
from tests.usage.test_billing_exact import start as start_host


def moorage(host: LocalHost, *args: str) -> Result:
    env = {"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key, "MOORAGE_DATA_DIR": str(host.data)}
    return CliRunner().invoke(app, list(args), env=env)


def tokens(host: LocalHost, *args: str) -> float:
    r = moorage(host, "usage", "--json", *args)
    assert r.exit_code == 0, (args, r.output)
    return json.loads(r.stdout)["totals"].get("input_tokens", 0.0)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def test_usage_of_a_period_and_of_one_user(tmp_path: Path) -> None:
    with WireServer(openai_app, "sk-test") as wire:
        wire.script.push(*[_reply() for _ in range(3)])  # each model call: 100 tokens in, 7 out
        host = start_host(wire, tmp_path / "data")
        try:
            with Client(host.url, host.key) as sdk:
                sdk.deploy("notes", write_agent(tmp_path, "notes", MODEL_AGENT))
                start = time.time()
                sdk.invoke("notes", "one", user="ada")
                middle = time.time()
                sdk.invoke("notes", "two", user="bob")
                sdk.invoke("notes", "three", user="bob")
            assert len(wire.script.requests) == 3
            assert tokens(host) == 300.0
            # A period as ISO-8601 times (its end excluded), as seconds since the epoch, or as UTC dates.
            assert tokens(host, "--since", iso(start), "--until", iso(middle)) == 100.0
            assert tokens(host, "--since", f"{middle:.6f}") == 200.0
            assert tokens(host, "--since", f"{middle:.6f}", "--until", iso(middle)) == 0.0  # an empty period
            today = datetime.now(timezone.utc).date()
            assert tokens(host, "--since", today.isoformat(), "--until", (today + timedelta(days=1)).isoformat()) \
                == 300.0
            assert tokens(host, "--until", today.isoformat()) == 0.0
            # One end-user, over all agents or one; with both a period and a user.
            assert tokens(host, "--user", "bob") == 200.0
            assert tokens(host, "--agent", "notes", "--user", "ada") == 100.0
            assert tokens(host, "--user", "bob", "--until", iso(middle)) == 0.0
            shown = moorage(host, "usage", "--user", "bob", "--since", iso(start))
            assert shown.exit_code == 0 and "input_tokens" in shown.stdout and "200" in shown.stdout, shown.output
        finally:
            host.stop()


def one_line_error(tmp_path: Path, *args: str) -> str:
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "usage", *args])
    assert r.exit_code == 2 and r.stdout == "" and "Traceback" not in r.output, (args, r.output)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_bad_period_is_one_line_naming_the_option_and_an_example(tmp_path: Path) -> None:
    # Refused before the server is asked (none runs here).
    for option, value in (("--since", "last week"), ("--until", "2026-13-01"), ("--since", "nan")):
        said = one_line_error(tmp_path, option, value)
        assert said.startswith(f"error: {option} {value!r} is not a date or time") and f"e.g. {option} 2026-" in said, \
            said
    said = one_line_error(tmp_path, "--since", "2026-11-02", "--until", "2026-11-01")
    assert said.startswith("error: --until 2026-11-01 is before --since 2026-11-02"), said
