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


def test_every_commands_help_shows_the_root_options_it_takes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`moorage up --config F` works (the root's options are read after the command too), yet `moorage up --help`
    did not show --config, --data-dir or --log-level: every command's and group's help now ends with them."""
    import subprocess
    import sys

    import typer

    monkeypatch.setenv("COLUMNS", "200")
    seen: list[str] = []

    def walk(cmd, words: list[str]) -> None:  # type: ignore[no-untyped-def]
        for name, child in (getattr(cmd, "commands", None) or {}).items():
            walk(child, [*words, name])
        if not words:
            return
        r = CliRunner().invoke(app, [*words, "--help"])
        said = " ".join(r.output.split())
        assert r.exit_code == 0, (words, r.output)
        assert "moorage's own options, taken here too" in said, (words, said)
        for option in ("--config FILE", "--data-dir DIR", "--log-level LEVEL"):
            assert option in said, (words, option, said)
        assert said.count("--data-dir DIR") == 1, (words, said)
        seen.append(" ".join(words))

    walk(typer.main.get_command(app), [])
    assert {"up", "deploy", "backup", "checkpoints", "checkpoints list", "memory eval", "hosts"} <= set(seen), seen
    # The installed command, as a user types it.
    up = subprocess.run([sys.executable, "-m", "moorage.cli.main", "up", "--help"], capture_output=True, text=True,
                        timeout=60)
    said = " ".join(up.stdout.split())
    assert up.returncode == 0 and "--config FILE Path to moorage.toml" in said and "--log-level LEVEL debug" in said, said


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`moorage up --help` listed --host and --port with nothing beside them (not what they default to, nor that port
    0 picks a free one): every option of every command has its line of help."""
    import typer

    bare: list[str] = []

    def walk(cmd: typer.core.TyperCommand, words: list[str]) -> None:
        for name, child in (getattr(cmd, "commands", None) or {}).items():
            walk(child, [*words, name])
        bare.extend(f"moorage {' '.join(words)} {p.opts[0]}" for p in cmd.params
                    if p.param_type_name == "option" and p.name != "help" and not (p.help or "").strip())

    walk(typer.main.get_command(app), [])
    assert bare == [], bare
