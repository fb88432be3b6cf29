"""`moorage store create-tenant` with a name that is taken: one line saying so and what to do, exit 2."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app


def test_create_tenant_twice_says_the_name_is_taken(tmp_path: Path) -> None:
    args = ["--data-dir", str(tmp_path), "store", "create-tenant", "initech"]
    assert CliRunner().invoke(app, args).exit_code == 0
    again = CliRunner().invoke(app, args)
    said = " ".join(again.output.split())
    assert again.exit_code == 2 and "'initech' already exists" in said and "moorage store tenants" in said, said
    assert "re-read" not in said and isinstance(again.exception, SystemExit), said  # a message, no traceback
