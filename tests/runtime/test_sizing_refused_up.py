"""A deploy this host cannot size (``vcpus`` beyond its CPUs) answers "nothing was changed", and through
``moorage up`` that is true: a new name leaves no agent behind (``moorage agents`` used to list it as "(none
live)") and an existing agent keeps its deployments as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moorage import Client
from moorage.client import BadRequest, NotFound
from moorage.cpus import usable_cpus
from moorage.devservices.fleet import LocalHost


def _agent(root: Path, name: str, extra: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n{extra}'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text("async def on_message(ctx, message):\n    return 'ok ' + message\n")
    return root


def test_a_deploy_refused_at_sizing_changes_nothing(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    env = {**os.environ, "MOORAGE_DATA_DIR": str(host.data), "MOORAGE_PORT": str(host.port)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moorage.cli.main", *args], env=env, capture_output=True,
                              text=True, timeout=300)
    too_many = f"vcpus = {usable_cpus() + 1}\n"
    try:
        # A new name: refused, and no agent, deployment or package is left of it.
        packages = set((host.data / "packages").glob("*")) if (host.data / "packages").exists() else set()
        r = cli("deploy", str(_agent(tmp_path / "big", "big", too_many)))
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode != 0 and "vcpus" in said and "nothing was changed" in said, said
        listed = cli("agents", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [a["name"] for a in json.loads(listed.stdout)["data"]] == []
        assert "big" not in cli("agents").stdout
        with Client(host.url, host.key) as sdk:
            assert sdk.list_agents()["data"] == []
            with pytest.raises(NotFound):
                sdk.list_deployments("big")
            assert set((host.data / "packages").glob("*")) - packages == set()
            # An agent that exists: refused the same way, its live deployment and its history as they were.
            sdk.deploy("small", _agent(tmp_path / "small", "small"))
            before = sdk.list_deployments("small")["data"]
            r = cli("deploy", str(_agent(tmp_path / "small2", "small", too_many)))
            assert r.returncode != 0 and "nothing was changed" in " ".join((r.stdout + r.stderr).split())
            after = sdk.list_deployments("small")["data"]
            assert [(d["number"], d["status"]) for d in after] == [(d["number"], d["status"]) for d in before]
            assert sdk.invoke("small", "still", user="ada")["reply"] == "ok still"
    finally:
        host.stop()


def test_debian_packages_on_a_driver_that_cannot_install_them_change_nothing(tmp_path: Path) -> None:
    """``[agent] apt`` on the process driver (its sandboxes do not run as root inside) was refused saying "nothing
    was changed" after the agent and a failed deployment were recorded; it is refused before either."""
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            with pytest.raises(BadRequest) as e:
                sdk.deploy("tools", _agent(tmp_path / "tools", "tools", 'apt = ["jq"]\n'))
            said = " ".join(str(e.value).split())
            assert "micro-VM driver" in said and "nothing was changed" in said, said
            assert sdk.list_agents()["data"] == []
            with pytest.raises(NotFound):
                sdk.list_deployments("tools")
    finally:
        host.stop()
