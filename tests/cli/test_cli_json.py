"""`--json` across the CLI: every command that shows something takes it and prints one JSON document on stdout
(status and errors on stderr); a failure exits non-zero, with the plain one-line error on stderr and nothing on stdout."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app


def cli(*args: str) -> "object":
    return CliRunner().invoke(app, list(args))


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
    listed = json.loads(scenarios.stdout)
    assert [s["name"] for s in listed] == list(SCENARIOS), listed
    text = cli("cost", "trace", "scenarios").stdout
    assert all(s["description"] in text and f"{s['users']:>5} users" in text for s in listed), text


def test_version_json() -> None:
    from moorage import __version__

    shown = cli("version", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout) == {"version": __version__}, shown.output
    assert cli("version").stdout.strip() == __version__
