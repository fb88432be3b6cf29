"""``Client()`` beside ``moorage up`` finds the local admin key as the CLI does (a key given or in MOORAGE_API_KEY
first), and never sends that key to a server on another machine; with no URL, it finds the server the CLI finds,
through the same configuration (``data_dir`` in ``./moorage.toml`` too)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from moorage import AsyncClient, Client
from moorage.client import AuthError
from moorage.devservices.fleet import LocalHost
from tests.cli.test_cli_e2e import MOORAGE


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    # Named as the default data directory under XDG_DATA_HOME is: <XDG_DATA_HOME>/moorage.
    server = LocalHost("up", tmp_path_factory.mktemp("local-key") / "moorage", {"MOORAGE_LOG_LEVEL": "warning"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("MOORAGE_API_KEY", "MOORAGE_API_URL", "MOORAGE_DATA_DIR", "XDG_DATA_HOME", "MOORAGE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_client_given_no_key_uses_the_key_moorage_up_wrote(host: LocalHost, no_key: pytest.MonkeyPatch) -> None:
    no_key.setenv("MOORAGE_DATA_DIR", str(host.data))
    with Client(host.url) as sdk:
        me = sdk.whoami()
    assert me["kind"] == "key" and "admin" in me["scopes"], me

    no_key.delenv("MOORAGE_DATA_DIR")
    no_key.setenv("XDG_DATA_HOME", str(host.data.parent))  # the default place: $XDG_DATA_HOME/moorage
    with Client(host.url.replace("127.0.0.1", "localhost")) as sdk:
        assert sdk.whoami()["scopes"] == me["scopes"]


async def test_the_async_client_finds_it_too(host: LocalHost, no_key: pytest.MonkeyPatch) -> None:
    no_key.setenv("MOORAGE_DATA_DIR", str(host.data))
    async with AsyncClient(host.url) as sdk:
        assert "admin" in (await sdk.whoami())["scopes"]


def test_a_key_given_or_in_the_environment_comes_first(host: LocalHost, no_key: pytest.MonkeyPatch) -> None:
    no_key.setenv("MOORAGE_DATA_DIR", str(host.data))
    with Client(host.url, "mrg_not-a-key") as sdk, pytest.raises(AuthError):
        sdk.whoami()
    no_key.setenv("MOORAGE_API_KEY", "mrg_not-a-key-either")
    with Client(host.url) as sdk, pytest.raises(AuthError):
        sdk.whoami()


def test_the_local_key_never_goes_to_another_machine(host: LocalHost, no_key: pytest.MonkeyPatch) -> None:
    no_key.setenv("MOORAGE_DATA_DIR", str(host.data))
    assert Path(host.data, "local-admin.key").exists()
    with Client("https://moorage.example.com") as sdk:
        assert sdk.settings.api_key is None and "authorization" not in sdk._http.headers


def test_a_client_finds_the_server_whose_data_dir_moorage_toml_names(host: LocalHost, no_key: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    no_key.setenv("XDG_DATA_HOME", str(tmp_path / "nothing-here"))  # the default data directory has no host
    # The file names the data directory relative to itself, as `moorage up` run in that directory reads it.
    project = host.data.parent
    (project / "moorage.toml").write_text(f'[moorage]\ndata_dir = "{host.data.name}"\n')
    no_key.chdir(project)
    with Client() as sdk:
        assert sdk.settings.base_url == host.url.rstrip("/"), sdk.settings.url_from
        assert "admin" in sdk.whoami()["scopes"]  # and the key of that data directory

    async def found() -> str:
        async with AsyncClient() as sdk:
            return (await sdk.whoami())["kind"]
    assert asyncio.run(found()) == "key"
    cli = subprocess.run([*MOORAGE, "agents", "--json"], capture_output=True, text=True, timeout=120, cwd=project)
    assert cli.returncode == 0 and json.loads(cli.stdout)["data"] == [], cli.stderr  # the CLI finds the same
