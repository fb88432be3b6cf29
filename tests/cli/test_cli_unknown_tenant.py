"""A tenant name the store does not have (a typo of --tenant) is one line that says where to see the tenants there
are, not only how to make a new one."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.config import Config
from moorage.store import open_store


def test_an_unknown_tenant_points_to_the_listing_of_tenants(tmp_path: Path) -> None:
    store = open_store(Config(data_dir=tmp_path))
    store.operator.create_tenant("acme")
    store.close()
    r = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "memory", "facts", "--tenant", "acme-typo",
                                 "--agent", "a", "--user", "u"])
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: no tenant 'acme-typo' (`moorage store tenants` lists them; create one "
                                     "with `moorage store create-tenant NAME`)"], r.stderr
    listed = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "store", "tenants"])
    assert listed.exit_code == 0 and "acme" in listed.stdout, listed.output
