"""The operator's ceiling on what one tenant keeps (``tenant_max_storage_mib``), the documented way: set in the
environment of `moorage up` (process driver), read through the SDK's ``usage()["storage"]`` and `moorage usage`.

``store_mib`` bounds each end-user; with ``users = "auto"`` a tenant's users are as many as its product makes, so
before this ceiling a tenant could keep without bound by spreading over users (usage/tenant_cap.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.client.errors import ApiError
from moorage.devservices.fleet import LocalHost
from tests.client.test_sdk_store_cap import _agent as hoarder
from tests.client.test_sdk_store_cap import _kept

REFUSED = "tenant-storage-exceeded: this tenant keeps "


def _agent(root: Path) -> Path:
    return hoarder(root, limits="")  # no store_mib: only the tenant's ceiling bounds it


def test_a_tenant_stops_at_the_operators_ceiling_over_all_its_users(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_TENANT_MAX_STORAGE_MIB": "4"},
                     start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("hoard", _agent(tmp_path / "hoard"))
            empty = sdk.usage()["storage"]
            assert empty["limit"] == 4 and 0 < empty["used"] < 1 and empty["store_bytes"] > 0, empty
            for user in ("ada", "bob"):  # their instances are made while there is room
                assert _kept(sdk.invoke("hoard", "0", user=user)["reply"])[0] == 0
            # ada fills what the tenant may keep (no store_mib of her own bounds her): the rest of the 4 MiB.
            n, rest = _kept(sdk.invoke("hoard", "60", user="ada")["reply"])
            assert 25 <= n <= 40 and rest.startswith("1 found; " + REFUSED), (n, rest)
            assert "its storage ceiling is 4 MiB; memory.append refused" in rest, rest
            # bob, another user of the same tenant, is refused too: spreading over users does not get past it.
            n, rest = _kept(sdk.invoke("hoard", "5", user="bob")["reply"])
            assert n == 0 and rest.startswith("0 found; " + REFUSED), rest
            with pytest.raises(ApiError) as e:  # the tenant's own writes of content as well
                sdk.add_fact("hoard", "bob", "bob", "motto", "x" * 200_000)
            assert e.value.status == 507 and e.value.type.endswith("/tenant-storage-exceeded"), e.value
            # A deploy of a package it does not have yet is more to keep: refused, nothing recorded; the same package
            # again keeps nothing more.
            other = _agent(tmp_path / "hoard2")
            (other / "moorage.toml").write_text((other / "moorage.toml").read_text().replace('"hoard"', '"hoard2"'))
            (other / "data.bin").write_bytes(os.urandom(300_000))  # a package of 300 kB, compressed
            with pytest.raises(ApiError) as e:
                sdk.deploy("hoard2", other)
            assert e.value.status == 507 and "a deploy of a new package refused" in e.value.detail, e.value
            assert [a["name"] for a in sdk.list_agents()["data"]] == ["hoard"]
            assert sdk.deploy("hoard", tmp_path / "hoard")["number"] == 2
            # Between measures a host counts what the calls hand the store; a measure counts the file, whose
            # full-text index and pages make it larger: within seconds of the last write it may read past 4.
            full = sdk.usage()["storage"]
            assert 3.8 < full["used"] < 4.5 and full["limit"] == 4, full
            assert "storage" not in sdk.usage(agent="hoard")  # the whole tenant's only
            shown = CliRunner().invoke(app, ["usage"], env={"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key})
            assert shown.exit_code == 0, shown.output
            assert re.search(r"cap tenant_max_storage_mib[\s│]+[34]\.\d+ of 4\b", shown.stdout), shown.output

            # An instance's disk counts too, from its sleep: bob writes 1 MB to his and sleeps, which puts the
            # tenant past its ceiling, and a new user's first turn (a new instance) is refused.
            bob = next(s for s in sdk.list_sandboxes(agent="hoard")["data"] if s["scope"].endswith("/bob"))
            assert sdk.exec(bob["id"], ["sh", "-c", "head -c 1000000 /dev/urandom > blob && sync"])["exit_code"] == 0
            assert sdk.sandbox_action(bob["id"], "sleep")["slept"] is True
            with pytest.raises(ApiError) as e:
                sdk.invoke("hoard", "0", user="carol")
            assert e.value.status == 507 and e.value.type.endswith("/tenant-storage-exceeded"), e.value
            assert "a new instance refused" in e.value.detail, e.value.detail
            assert sdk.usage()["storage"]["used"] > 4
            ck = sdk.list_checkpoints("hoard", "bob")["data"][0]  # taken at the end of his turn (not refused)
            for refused in (lambda: sdk.take_checkpoint("hoard", "bob", name="before"),  # each would keep more
                            lambda: sdk.fork_checkpoint("hoard", "bob", ck["id"], ["dora", "erin"])):
                with pytest.raises(ApiError) as e:
                    refused()
                assert e.value.status == 507 and e.value.type.endswith("/tenant-storage-exceeded"), e.value
            # Turns of the instances it has still run and read.
            assert _kept(sdk.invoke("hoard", "0", user="bob")["reply"]) == (0, "0 found; none")

            # Deleting ada frees what she kept, at once: bob keeps memories again, carol gets her instance.
            sdk.delete_user("hoard", "ada")
            n, rest = _kept(sdk.invoke("hoard", "3", user="bob")["reply"])
            assert n == 3 and rest == "1 found; none", rest
            assert _kept(sdk.invoke("hoard", "1", user="carol")["reply"])[0] == 1
            now = sdk.usage()["storage"]  # measured again since the delete: bob's disk as it last slept
            assert now["used"] < 3 and now["instance_bytes"] >= 1_000_000, now
    finally:
        host.stop()



def test_a_tenants_own_ceiling_set_by_the_operator_applies_to_it_alone(tmp_path: Path) -> None:
    """`moorage store tenant-limits NAME --storage-mib N` on the host's store: that tenant stops at its N, another
    tenant of the same host (no ceiling, the default) is not bounded by it."""
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        env = {"MOORAGE_DATA_DIR": str(tmp_path / "data")}
        made = CliRunner().invoke(app, ["store", "create-tenant", "globex", "--json"], env=env)
        assert made.exit_code == 0, made.output
        globex_key = json.loads(made.stdout)["api_key"]
        set_ = CliRunner().invoke(app, ["store", "tenant-limits", "globex", "--storage-mib", "2"], env=env)
        assert set_.exit_code == 0 and "globex: storage ceiling 2 MiB (its own)" in set_.stdout, set_.output
        listed = CliRunner().invoke(app, ["store", "tenants", "--json"], env=env)
        assert {t["name"]: t["limits"] for t in json.loads(listed.stdout)["data"]} == \
            {"globex": {"storage_mib": 2.0}, "local": {}}, listed.output
        with Client(host.url, globex_key) as globex, Client(host.url, host.key) as local:
            for sdk in (globex, local):
                sdk.deploy("hoard", _agent(tmp_path / f"hoard-{id(sdk)}"))
            n, rest = _kept(globex.invoke("hoard", "30", user="ada")["reply"])
            assert 10 <= n <= 20 and "its storage ceiling is 2 MiB; memory.append refused" in rest, (n, rest)
            assert globex.usage()["storage"]["limit"] == 2
            assert _kept(local.invoke("hoard", "30", user="ada")["reply"]) == (30, "1 found; none")
            assert "storage" not in local.usage()

            # The operator raises it over HTTP with the operator token: the host that served it applies it to the
            # tenant's next write (the tenant's own key may not).
            token = (tmp_path / "data" / "api" / "operator-token").read_text().strip()
            assert httpx.put(f"{host.url}/v1/tenants/globex/limits", json={"storage_mib": 64},
                             headers={"Authorization": f"Bearer {globex_key}"}).status_code == 401
            r = httpx.put(f"{host.url}/v1/tenants/globex/limits", json={"storage_mib": 64},
                          headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json()["storage_mib"] == 64, r.text
            assert _kept(globex.invoke("hoard", "5", user="ada")["reply"])[0] == 5
            assert globex.usage()["storage"]["limit"] == 64
    finally:
        host.stop()
