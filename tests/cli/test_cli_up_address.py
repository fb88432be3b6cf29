"""`moorage up --port N` records where it serves in its data directory, and the CLI and `Client()` on the same
machine go there when no URL is set (they went to port 7700 and could not reach it). MOORAGE_API_URL comes first; a
clean stop removes the record, and one a crash left behind (its pid gone) is passed over, the error saying which
address was tried and where it came from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage import AsyncClient, Client
from moorage.devservices.postgres import free_port
from tests.cli.test_cli_e2e import MOORAGE, ROOT, run

UNSET = ("MOORAGE_API_URL", "MOORAGE_API_KEY", "MOORAGE_PORT", "MOORAGE_HOST", "MOORAGE_DATA_DIR", "XDG_DATA_HOME",
         "MOORAGE_CONFIG")


def _env(data: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return {**env, "MOORAGE_DATA_DIR": str(data), "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_LOG_LEVEL": "warning",
            **extra}


def _up(data: Path, port: int) -> subprocess.Popen[bytes]:
    log = open(data.parent / f"up-{port}.log", "ab")
    proc = subprocess.Popen([*MOORAGE, "up", "--port", str(port)], env=_env(data), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while not _records(data, port) or not _healthy(port):
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:  # serving, but it never said where: stopped here, not left behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            raise AssertionError(f"moorage up on {port} did not record where it serves: "
                                 + (data.parent / f"up-{port}.log").read_text()[-3000:])
        time.sleep(0.2)
    return proc


def _records(data: Path, port: int) -> bool:
    """Whether ``moorage-up.json`` names ``port``: a crashed host's record stays until the next one serves and
    writes its own, a moment after it answers."""
    try:
        return json.loads((data / "moorage-up.json").read_text())["url"].endswith(f":{port}")
    except (OSError, ValueError, KeyError):
        return False


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOORAGE_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    yield tmp_path / "data"


def test_the_cli_and_the_sdk_find_the_port_moorage_up_serves_on(data: Path) -> None:
    port = free_port()
    proc = _up(data, port)
    try:
        record = json.loads((data / "moorage-up.json").read_text())
        assert record == {"url": f"http://127.0.0.1:{port}", "pid": proc.pid}
        listed = run(["agents", "--json"], _env(data))
        assert listed.returncode == 0 and json.loads(listed.stdout)["data"] == [], listed.stderr
        with Client() as sdk:
            assert sdk.settings.base_url == f"http://127.0.0.1:{port}"
            assert "admin" in sdk.whoami()["scopes"]  # the key found beside it, for the address found beside it

        async def whoami() -> dict[str, object]:
            async with AsyncClient() as sdk:
                return await sdk.whoami()
        import asyncio
        assert "admin" in asyncio.run(whoami())["scopes"]

        # An address set explicitly comes first, for the CLI and the SDK alike.
        elsewhere = f"http://127.0.0.1:{free_port()}"
        refused = run(["agents"], _env(data, MOORAGE_API_URL=elsewhere))
        assert refused.returncode == 2 and elsewhere in refused.stderr and "MOORAGE_API_URL" in refused.stderr
        os.environ["MOORAGE_API_URL"] = elsewhere
        try:
            assert Client().settings.base_url == elsewhere
        finally:
            del os.environ["MOORAGE_API_URL"]

        # A crash leaves the record; the pid it names is gone, so nobody is sent to an address that may be another's.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert (data / "moorage-up.json").exists()
        with Client() as sdk:
            assert sdk.settings.base_url != f"http://127.0.0.1:{port}"
            assert "no running `moorage up`" in sdk.settings.url_from
        dead = free_port()
        gone = run(["agents"], _env(data, MOORAGE_PORT=str(dead)))
        assert gone.returncode == 2 and f"127.0.0.1:{dead}" in gone.stderr, gone.stderr
        assert "no running `moorage up` recorded its address" in gone.stderr, gone.stderr

        # Started again it records itself anew; a clean stop removes the record.
        port = free_port()
        proc = _up(data, port)
        assert json.loads((data / "moorage-up.json").read_text())["url"] == f"http://127.0.0.1:{port}"
        assert run(["agents"], _env(data)).returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert not (data / "moorage-up.json").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_the_cli_never_sends_this_machines_admin_key_to_another_server(data: Path) -> None:
    """With MOORAGE_API_URL naming another machine's server and no MOORAGE_API_KEY, the CLI sent that server the
    local admin key it read from the data directory (the SDK's Client() already kept it to this machine). It now
    refuses before sending anything, saying to set the other server's key. 127.0.0.2 stands in for another machine:
    it is not one of the names a server on this machine answers to."""
    from tests.client.loopback import Loopback, reply

    data.mkdir(parents=True, exist_ok=True)
    (data / "local-admin.key").write_text("mrg_local_admin_secret\n")
    seen: list[str] = []

    def record(handler: Any) -> None:
        seen.append(handler.headers.get("authorization") or "")
        reply(handler, 200, b'{"data": []}', {"content-type": "application/json"})

    with Loopback(record, host="127.0.0.2") as other:
        elsewhere = other.url
        r = run(["agents"], _env(data, MOORAGE_API_URL=elsewhere))
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith(f"error: no API key for {elsewhere}") and "MOORAGE_API_KEY" in r.stderr, r.stderr
    assert seen == [], seen  # nothing was sent there, the local admin key least of all


def test_port_0_serves_where_the_kernel_put_it_and_the_cli_and_share_links_go_there(data: Path, tmp_path: Path) -> None:
    """`moorage up --port 0` listens on a free port the kernel picks, says which as it starts and records it; the CLI
    run without a port reaches it there, and a share link it prints points there (it pointed at host:port of the
    CLI's own configuration: port 7700, where nothing served)."""
    from tests.cli.test_cli_live import app_archive
    from tests.upproc import moorage_up

    log = tmp_path / "up-0.log"
    with moorage_up(data, _env(data), log, "--port", "0") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        assert port != 0 and f"moorage is up at http://127.0.0.1:{port}" in " ".join(log.read_text().split())
        with Client() as sdk:
            assert sdk.settings.base_url == url
            sdk.deploy("web", app_archive(tmp_path, "web"))
            sdk.put_user("web", "ada")
        made = run(["share", "web", "ada", "--ttl", "15m", "--json"], _env(data))
        assert made.returncode == 0, made.stderr
        link = json.loads(made.stdout)["url"]
        assert link.startswith(f"{url}/v1/shared/"), link
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0


def test_a_fleet_host_on_port_0_needs_the_address_others_reach_it_at(data: Path) -> None:
    """Other hosts reach a fleet host at its ``host_url``, else at host:port, which for port 0 names no port."""
    refused = run(["up", "--port", "0"], _env(data, MOORAGE_STORE_URL="postgresql://nobody@127.0.0.1:1/none",
                                              MOORAGE_OBJECT_STORE_URL=f"file://{data}/objects"))
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "a fleet host on port 0 needs host_url" in said, refused.stderr
    assert "MOORAGE_HOST_URL" in said and "Traceback" not in said


def test_a_host_served_beyond_loopback_says_its_http_is_plain(data: Path, tmp_path: Path) -> None:
    """`--host 0.0.0.0` serves keys and tokens to the network unencrypted: the start says so, and where to read how to
    put TLS in front; on loopback (the default) it says nothing of it."""
    from moorage.cli.up import loopback_only
    from tests.upproc import moorage_up

    assert [loopback_only(h) for h in ("127.0.0.1", "127.0.0.9", "::1", "localhost")] == [True] * 4
    assert [loopback_only(h) for h in ("0.0.0.0", "::", "10.0.0.5", "moorage.example.com")] == [False] * 4
    said = {}
    for host in ("127.0.0.1", "0.0.0.0"):
        log = tmp_path / f"up-{host}.log"
        with moorage_up(data, _env(data), log, "--host", host, "--port", "0") as (proc, url):
            assert url.startswith("http://127.0.0.1:")  # a wildcard address is reached on loopback here
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
        said[host] = " ".join(log.read_text().split())
    assert "plain HTTP beyond this machine" not in said["127.0.0.1"], said
    assert 'plain HTTP beyond this machine: API keys and end-user tokens cross the network unencrypted; put a TLS ' \
           'proxy in front (docs/operations.md, "Serve it over HTTPS")' in said["0.0.0.0"], said
