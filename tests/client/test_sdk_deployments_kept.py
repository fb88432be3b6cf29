"""An agent's deployments kept the documented ways, through `moorage up` (process driver): `[agent.retention]
keep_deployments` in moorage.toml deletes the oldest as each deploy goes live, `moorage deployments delete` deletes
one by hand, and what they free shows in the tenant's storage (its packages) and leaves the host's disk at the next
collection. Before, every deployment and its package were kept for good, so a tenant with a storage ceiling that
deployed often ran into it with no way out."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.client.errors import ApiError
from moorage.devservices.fleet import LocalHost


def _agent(root: Path, n: int) -> Path:
    d = root / f"big-{n}"
    d.mkdir(parents=True)
    (d / "moorage.toml").write_text('[agent]\nname = "big"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                                    '[agent.retention]\nkeep_deployments = 2\n')
    (d / "agent.py").write_text(f'async def on_message(ctx, message):\n    return "v{n}: " + message\n')
    (d / "data.bin").write_bytes(os.urandom(200_000))  # 200 kB that does not compress: each package its own
    return d


def _until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_kept_and_deleted_deployments_free_the_tenants_storage_and_the_hosts_disk(tmp_path: Path) -> None:
    data = tmp_path / "data"
    host = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_TENANT_MAX_STORAGE_MIB": "64",
                                  "MOORAGE_TEMPLATE_GC_INTERVAL_S": "1", "MOORAGE_TEMPLATE_GC_GRACE_S": "1"},
                     start_timeout_s=120)
    cli_env = {"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key}

    def files() -> set[str]:
        return {p.name.removesuffix(".tar.gz") for p in (data / "packages").glob("*.tar.gz")}

    try:
        with Client(host.url, host.key) as sdk:
            deps = [sdk.deploy("big", _agent(tmp_path, n)) for n in (1, 2, 3)]
            sha = {d["number"]: d["package_sha256"] for d in deps}
            size = {n: len((data / "packages" / f"{s}.tar.gz").read_bytes()) if n > 1 else 0 for n, s in sha.items()}
            # The third deploy went live keeping two: #1 is gone from the list, as a rollback's target, and from the
            # tenant's storage; its file leaves the disk at the next collection.
            assert [d["number"] for d in sdk.list_deployments("big")["data"]] == [2, 3]
            with pytest.raises(ApiError) as e:
                sdk.rollback("big", 1)
            assert e.value.status == 404 and "was deleted" in e.value.detail, e.value
            assert sdk.usage()["storage"]["package_bytes"] == size[2] + size[3]
            _until(lambda: sha[1] not in files(), "the package of #1 to leave the disk")
            assert files() == {sha[2], sha[3]}
            assert sdk.invoke("big", "hi", user="ada")["reply"] == "v3: hi"

            # By hand, from the CLI: not the live one (its hint says what to do), then #2.
            listed = CliRunner().invoke(app, ["deployments", "list", "big", "--json"], env=cli_env)
            assert listed.exit_code == 0, listed.output
            assert [d["number"] for d in json.loads(listed.stdout)["data"]] == [2, 3]
            live = CliRunner().invoke(app, ["deployments", "delete", "big", "3"], env=cli_env)
            assert live.exit_code != 0 and "live" in live.output and "roll back" in live.output, live.output
            gone = CliRunner().invoke(app, ["deployments", "delete", "big", "2"], env=cli_env)
            assert gone.exit_code == 0 and "deleted deployment #2 of big" in gone.stdout, gone.output
            assert sdk.usage()["storage"]["package_bytes"] == size[3]
            _until(lambda: files() == {sha[3]}, "the package of #2 to leave the disk")
            assert sdk.invoke("big", "hi", user="bob")["reply"] == "v3: hi"
            # A new deploy numbers on: #4, and #3 stays for a rollback (two kept).
            assert sdk.deploy("big", _agent(tmp_path, 4))["number"] == 4
            assert sdk.rollback("big")["number"] == 3
            assert sdk.invoke("big", "hi", user="ada")["reply"] == "v3: hi"
    finally:
        host.stop()
