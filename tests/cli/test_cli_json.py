"""`--json` across the CLI: every command that shows something takes it and prints one JSON document on stdout
(status and errors on stderr); a failure exits non-zero, with the plain one-line error on stderr and nothing on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from typer.testing import CliRunner

from moorage.cli.main import app


def cli(*args: str) -> "object":
    return CliRunner().invoke(app, list(args))


#: The commands that only act: what they print is a confirmation or progress for a person, nothing a script reads
#: back (a script checks their exit status). Every other command shows something and takes --json.
ONLY_ACT = {
    "up": "serves until stopped",
    "bench": "runs a benchmark; its report is written to bench/results/latest/<area>.json",
    "chat": "an interactive conversation (`invoke --json` is the scripted turn)",
    "backup": "copies the data directory to DEST",
    "image prune": "removes unused images",
    "cost trace generate": "writes a trace file (--out)",
    "memory eval generate": "writes a dataset file (--out)",
    "store migrate": "brings the schema up to date (`store info --json` shows the version)",
    "secrets set": "stores a value (never shown)",
    "secrets rm": "removes one",
    "secrets rotate-key": "re-encrypts under a new key",
    "hosts drain": "marks a host draining",
    "host drain": "the same, under the group's other name",
}


def commands() -> dict[str, Any]:
    """Every command `moorage --help` leads to, by its words (a group that runs on its own, like `hosts`, too)."""
    found: dict[str, Any] = {}

    def walk(cmd: Any, words: list[str]) -> None:
        sub = getattr(cmd, "commands", None)
        if sub is None or (words and getattr(cmd, "invoke_without_command", False)):
            found[" ".join(words)] = cmd
        for name, child in (sub or {}).items():
            walk(child, [*words, name])

    walk(typer.main.get_command(app), [])
    return found


def test_every_command_that_shows_something_takes_json() -> None:
    found = commands()
    assert {"agents", "store info", "hosts", "memory eval", "checkpoints list", "cost trace scenarios"} <= set(found)
    assert not set(ONLY_ACT) - set(found), "a command here no longer exists: take it off the list"
    missing = [name for name, cmd in found.items() if name not in ONLY_ACT and not any(
        "--json" in p.opts and getattr(p, "is_flag", False) for p in cmd.params)]
    assert not missing, f"these show something but take no --json flag: {missing}"


def test_store_info_json_names_the_store_and_its_schema_version(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path)]
    assert cli(*data, "store", "create-tenant", "initech").exit_code == 0  # makes the store
    shown = cli(*data, "store", "info", "--json")
    assert shown.exit_code == 0, shown.output
    info = json.loads(shown.stdout)
    human = cli(*data, "store", "info").stdout
    assert info["store"].startswith("sqlite ") and str(tmp_path / "store") in info["store"], info
    assert isinstance(info["schema_version"], int) and info["schema_version"] >= 1, info
    assert info["store"] in human and f"control schema v{info['schema_version']}" in human, human


def test_store_info_without_a_store_fails_saying_how_to_make_one(tmp_path: Path) -> None:
    for extra in ([], ["--json"]):
        shown = cli("--data-dir", str(tmp_path), "store", "info", *extra)
        said = " ".join(shown.stderr.split())
        assert shown.exit_code == 2 and shown.stdout == "", shown.output
        assert said.startswith("error: no store yet at") and "moorage store migrate" in said, said
    assert not (tmp_path / "store").exists()  # asking made none


def test_store_sweep_json_counts_what_it_swept(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path)]
    nothing = cli(*data, "store", "sweep", "--json")  # no store yet: said on stderr, a sweep of nothing on stdout
    assert nothing.exit_code == 0 and json.loads(nothing.stdout) == {"scopes": 0, "rows": 0}, nothing.output
    assert "no store yet" in nothing.stderr and not (tmp_path / "store").exists()
    assert cli(*data, "store", "create-tenant", "initech").exit_code == 0
    swept = cli(*data, "store", "sweep", "--json")
    assert swept.exit_code == 0, swept.output
    rep = json.loads(swept.stdout)
    assert set(rep) == {"scopes", "rows"} and all(isinstance(v, int) for v in rep.values()), rep
    assert f"swept {rep['scopes']} expired scopes ({rep['rows']} rows)" in cli(*data, "store", "sweep").stdout


def test_cost_prices_and_scenarios_json_hold_what_their_text_shows() -> None:
    from moorage.cost import SCENARIOS

    prices = cli("cost", "prices", "--json")
    assert prices.exit_code == 0, prices.output
    table, toml = json.loads(prices.stdout), cli("cost", "prices").stdout
    for section in ("prices", "instance"):
        for name, value in table[section].items():
            assert f"{name} = {json.dumps(value)}" in toml, (name, value)
    assert f"# break-even idle gap: {table['break_even_s']:.1f} s" in toml
    scenarios = cli("cost", "trace", "scenarios", "--json")
    assert scenarios.exit_code == 0, scenarios.output
    listed = json.loads(scenarios.stdout)["data"]
    assert [s["name"] for s in listed] == list(SCENARIOS), listed
    text = cli("cost", "trace", "scenarios").stdout
    assert all(s["description"] in text and f"{s['users']:>5} users" in text for s in listed), text


def test_version_json() -> None:
    from moorage import __version__

    shown = cli("version", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout) == {"version": __version__}, shown.output
    assert cli("version").stdout.strip() == __version__


def test_llm_providers_json_names_the_configured_model_and_url_as_the_text_does() -> None:
    env = {"MOORAGE_LLM_PROVIDER": "openai", "MOORAGE_LLM_MODEL": "gpt-x", "MOORAGE_LLM_BASE_URL": "http://127.0.0.1:9/v1"}
    shown = CliRunner().invoke(app, ["llm", "providers", "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    rows = {r["name"]: r for r in json.loads(shown.stdout)["data"]}
    assert (rows["openai"]["configured"], rows["openai"]["model"], rows["openai"]["base_url"]) == \
        (True, "gpt-x", "http://127.0.0.1:9/v1"), rows
    assert rows["embedded"]["model"] is None and rows["anthropic"]["base_url"] is None, rows
    text = " ".join(CliRunner().invoke(app, ["llm", "providers"], env=env).stdout.split())
    assert "llm_provider=openai model=gpt-x base_url=http://127.0.0.1:9/v1" in text, text
