"""``moorage llm`` against the real embedded model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app


def test_chat_with_the_embedded_model(tmp_path: Path) -> None:
    (tmp_path / "none.toml").write_text("")  # an empty configuration: nothing from a moorage.toml in the cwd
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "llm", "chat", "Say hello.", "--max-tokens", "4", "--temperature", "0", "--json"],
                           env={"MOORAGE_LLM_PROVIDER": "embedded", "MOORAGE_CONFIG": str(tmp_path / "none.toml")})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert doc["text"] and doc["provider"] == "embedded"
    assert doc["usage"]["input_tokens"] > 0 and 0 < doc["usage"]["output_tokens"] <= 4


def test_providers_lists_the_configured_one(tmp_path: Path) -> None:
    (tmp_path / "none.toml").write_text("")
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "llm", "providers", "--json"],
                           env={"MOORAGE_LLM_PROVIDER": "anthropic", "MOORAGE_CONFIG": str(tmp_path / "none.toml")})
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)["data"]}
    assert set(rows) == {"embedded", "openai", "anthropic"}
    assert rows["anthropic"]["configured"] and not rows["embedded"]["configured"]
    assert rows["embedded"]["exact_token_count"]
