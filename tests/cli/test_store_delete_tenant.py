"""Deleting a tenant the documented way, through `moorage up` (process driver): `moorage store delete-tenant` asks
first, shows progress on stderr, and the host it asks stops the tenant's instances and removes them from its disk;
the tenant's keys stop working at once; the tenant's SQLite file goes; the host's own tenant is untouched; a tenant
that does not exist is one line of error. Deleting the host's own `local` tenant: the next `moorage up` makes a new
one (its key written where the CLI reads it), instead of serving a dead key."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.client.errors import ApiError
from moorage.devservices.fleet import LocalHost


def _agent(root: Path) -> Path:
    d = root / "helper"
    d.mkdir(parents=True)
    (d / "moorage.toml").write_text('[agent]\nname = "helper"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (d / "agent.py").write_text("async def on_message(ctx, message):\n    return 'helper: ' + message\n")
    return d


def test_a_tenant_deleted_from_the_cli_leaves_the_host_and_its_keys_stop_working(tmp_path: Path) -> None:
    data = tmp_path / "data"
    host = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    env = {"MOORAGE_DATA_DIR": str(data)}
    cli = CliRunner()
    try:
        made = cli.invoke(app, ["store", "create-tenant", "acme", "--json"], env=env)
        assert made.exit_code == 0, made.output
        acme = json.loads(made.stdout)
        with Client(host.url, acme["api_key"]) as sdk, Client(host.url, host.key) as local:
            sdk.deploy("helper", _agent(tmp_path / "a"))
            local.deploy("helper", _agent(tmp_path / "b"))
            for user in ("ada", "bob"):
                assert sdk.invoke("helper", "hi", user=user)["reply"] == "helper: hi"
            assert local.invoke("helper", "hi", user="ada")["reply"] == "helper: hi"
            boxes = {i["id"] for i in sdk.list_sandboxes()["data"]}
            kept = {i["id"] for i in local.list_sandboxes()["data"]}
            assert len(boxes) == 2 and all((data / "sandboxes" / b).is_dir() for b in boxes | kept)
            tenant_files = list((data / "store").rglob(f"*{acme['tenant']}*"))  # its database, its blob log
            assert tenant_files

            asked = cli.invoke(app, ["store", "delete-tenant", "acme"], env=env, input="n\n")
            assert asked.exit_code == 1 and sdk.invoke("helper", "again", user="ada")["reply"] == "helper: again"
            done = cli.invoke(app, ["store", "delete-tenant", "acme"], env=env, input="y\n")
            assert done.exit_code == 0, done.output
            assert "deleted tenant acme" in done.stdout and "agents 1, end-users forgotten 2" in done.stdout, done.stdout
            assert "acme: deleting agent helper (1 of 1)" in done.stderr, done.stderr  # progress, a line each

            for call in (lambda: sdk.invoke("helper", "hi", user="ada"), sdk.list_agents):
                try:
                    call()
                    raise AssertionError("a key of a deleted tenant still works")
                except ApiError as e:
                    assert e.status == 401, e
            assert not any((data / "sandboxes" / b).exists() for b in boxes)
            assert list((data / "store").rglob(f"*{acme['tenant']}*")) == [], tenant_files
            listed = json.loads(cli.invoke(app, ["store", "tenants", "--json"], env=env).stdout)["data"]
            assert [t["name"] for t in listed] == ["local"]
            assert local.invoke("helper", "again", user="ada")["reply"] == "helper: again"
            assert all((data / "sandboxes" / k).is_dir() for k in kept)

        again = cli.invoke(app, ["store", "delete-tenant", "acme", "--yes"], env=env)
        assert again.exit_code == 2 and again.stdout == "", again.output
        assert again.stderr.startswith("error: 404: no tenant 'acme'") and len(again.stderr.splitlines()) == 1, \
            again.stderr

        # The host's own tenant too: the next start makes a new, empty one, and writes its key where the CLI reads it.
        assert cli.invoke(app, ["store", "delete-tenant", "local", "--yes"], env=env).exit_code == 0
    finally:
        host.stop()
    host = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        listed = cli.invoke(app, ["agents", "--json"], env={**env, "MOORAGE_API_URL": host.url})
        assert listed.exit_code == 0 and json.loads(listed.stdout)["data"] == [], listed.output
        assert [t["name"] for t in json.loads(cli.invoke(app, ["store", "tenants", "--json"], env=env).stdout)["data"]] \
            == ["local"]
    finally:
        host.stop()
