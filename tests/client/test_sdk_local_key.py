"""``Client()`` beside ``moorage up`` finds the local admin key as the CLI does (a key given or in MOORAGE_API_KEY
first), and never sends that key to a server on another machine."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from moorage import AsyncClient, Client
from moorage.client import AuthError
from moorage.devservices.fleet import LocalHost


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
    for name in ("MOORAGE_API_KEY", "MOORAGE_API_URL", "MOORAGE_DATA_DIR", "XDG_DATA_HOME"):
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
