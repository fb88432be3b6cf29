"""`moorage hosts` against the fleet's real PostgreSQL store: an unknown host is one line saying where to look."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moorage.cli.main import app


def test_draining_an_unknown_host_says_how_to_list_them(pg_url: str) -> None:
    listed = CliRunner().invoke(app, ["hosts", "--store-url", pg_url, "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout) == {"data": []}, listed.output
    r = CliRunner().invoke(app, ["hosts", "drain", "no-such-host", "--store-url", pg_url])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert said == "error: no host 'no-such-host' (`moorage hosts` lists the fleet's hosts)", said
