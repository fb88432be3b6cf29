"""Ids a user types never reach another route: `moorage share … --revoke ..` once deleted the user itself. The
commands use the SDK's methods, whose path segments refuse such ids before anything is sent."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app


@pytest.mark.parametrize("args", [["share", "coder", "dev", "--revoke", ".."], ["secrets", "rm", "coder", ".."],
                                  ["secrets", "rm", "coder", "KEY", "--user", ".."], ["share", "coder", "..", "--list"]])
def test_share_and_secrets_refuse_ids_that_would_climb_the_path(args: list[str], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MOORAGE_API_URL", "http://127.0.0.1:9")  # unreachable: only a refusal passes the test
    monkeypatch.setenv("MOORAGE_API_KEY", "mrg_test")
    r = CliRunner().invoke(app, args)
    # (`moorage` itself prints a typed error as one line, exit 2: the runner here hands it back as is.)
    said = r.output + str(r.exception or "")
    assert r.exit_code != 0 and "is not a valid id" in said and "Connect" not in said, said
