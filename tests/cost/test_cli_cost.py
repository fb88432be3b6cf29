"""`moorage cost ...` end to end through typer's CliRunner: generate a trace, simulate it, read the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app

runner = CliRunner()


def _generate(tmp_path: Path, scenario: str = "mixed", users: str = "12", hours: str = "6") -> Path:
    out = tmp_path / "trace.jsonl"
    r = runner.invoke(app, ["cost", "trace", "generate", "--scenario", scenario, "--out", str(out), "--users", users, "--hours", hours, "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and out.exists()
    return out


def test_generate_then_simulate_json(tmp_path: Path) -> None:
    trace = _generate(tmp_path)
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    names = [x["policy"] for x in doc["results"]]
    assert names == ["always-on", "fixed-10s", "fixed-30s", "fixed-1min", "fixed-5min", "fixed-15min", "adaptive", "hindsight"]
    assert doc["trace"]["scenario"] == "mixed" and doc["trace"]["instances"] == 12
    for x in doc["results"]:
        for key in ("compute_s", "storage_gb_h", "wakes", "latency_p50_s", "latency_p99_s", "cost_total"):
            assert key in x
    assert doc["findings"]


def test_simulate_table_with_prices_and_chosen_policies(tmp_path: Path) -> None:
    trace = _generate(tmp_path, "periodic", "4", "8")
    prices = tmp_path / "prices.toml"
    prices.write_text('[prices]\ncurrency = "EUR"\n')
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(trace), "--prices", str(prices), "--policy", "fixed:300", "--policy", "adaptive"])
    assert r.exit_code == 0, r.output
    assert "fixed-5min" in r.output and "adaptive" in r.output and "EUR" in r.output
    assert "always-on" not in r.output
    assert "never fired" in r.output


def test_warm_pool_and_cold_boot_options(tmp_path: Path) -> None:
    trace = _generate(tmp_path, "many-idle", "40", "4")
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(trace), "--json", "--policy", "always-on", "--provisioning", "cold-boot"])
    assert r.exit_code == 0, r.output
    cold = json.loads(r.output)["results"][0]
    assert abs(cold["latency_max_s"] - 3.7) < 1e-6
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(trace), "--json", "--policy", "always-on", "--warm-pool", "64"])
    pooled = json.loads(r.output)["results"][0]
    assert pooled["latency_max_s"] < 0.01 and pooled["pool_compute_s"] > 0
    # The table shows what a new user's first turn waits too, not only the JSON.
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(trace), "--policy", "always-on", "--provisioning", "cold-boot"])
    assert r.exit_code == 0 and "1st turn p99" in r.output and "3700 ms" in r.output, r.output


def test_prices_and_scenarios_commands() -> None:
    r = runner.invoke(app, ["cost", "prices"])
    assert r.exit_code == 0 and "[prices]" in r.output and "break-even" in r.output
    r = runner.invoke(app, ["cost", "trace", "scenarios"])
    assert r.exit_code == 0 and "chatty" in r.output


def test_errors_are_typed(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance": "a"}\n')
    # Each is one line naming what is wrong, exit status 2 (the CLI's handling of moorage's own errors).
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(bad)])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "line 1" in r.output, r.output
    r = runner.invoke(app, ["cost", "trace", "generate", "--scenario", "nope", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "nope" in r.output, r.output
    r = runner.invoke(app, ["cost", "simulate", "--trace", str(bad), "--policy", "sometimes"])
    assert r.exit_code == 2 and "sometimes" in r.output, r.output
