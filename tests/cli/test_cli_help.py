"""What `moorage --help` says about settings is what config.py does."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moorage import config
from moorage.cli.main import app


def test_data_dir_help_names_the_default_config_uses(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "200")
    said = " ".join(CliRunner().invoke(app, ["--help"]).output.split())
    assert "--data-dir" in said and "$XDG_DATA_HOME/moorage" in said, said
    assert "~/.local/share/moorage where XDG_DATA_HOME is unset" in said, said
    # ... which is what loading the configuration gives.
    assert config.load(env={"XDG_DATA_HOME": str(tmp_path)}).data_dir == tmp_path / "moorage"
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert config.load(env={}).data_dir == Path.home() / ".local" / "share" / "moorage"
