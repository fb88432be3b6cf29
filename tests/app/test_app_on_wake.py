"""The agent module's ``on_wake(ctx)`` brings back what a process-driver sleep stopped: it runs before the first
app request or turn after a start or a wake, once, so a server the agent started with ``ctx.spawn`` serves its app
again after the wake (before, nothing restarted it and the app answered 502 until a turn did)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost

AGENT = '''
import os, sys

async def on_wake(ctx):
    ctx.files.write("site/index.html", "served by the spawned server")
    with open(os.path.join(ctx.files.root, "wakes.log"), "a") as f:
        f.write("wake\\n")
    try:
        await ctx.memory.recall("anything")
        kind = "none"
    except ctx.HostError as e:
        kind = e.kind
    ctx.files.write("host-call.txt", kind)
    await ctx.spawn([sys.executable, "-m", "http.server", "8080", "--bind", "127.0.0.1",
                     "--directory", os.path.join(ctx.files.root, "site")], log="server.log")

async def on_message(ctx, message):
    return "%s %s" % (ctx.files.read("wakes.log").count("wake"), ctx.files.read("host-call.txt"))
'''


@pytest.fixture(scope="module", params=["process", "microvm"])
def host(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    # The micro-VM keeps the spawned server across its sleep: on_wake runs there too (the server it starts again
    # finds the port taken and ends), so an agent written for one driver works on the other.
    images = os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")
    server = LocalHost("up", tmp_path_factory.mktemp("on-wake") / "data",
                       {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_TEST_IMAGES_DIR": images},
                       driver=request.param, start_timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


def _page(host: LocalHost) -> str:
    with host.client(host.key) as c:
        deadline = time.monotonic() + 30
        while True:
            r = c.get("/v1/agents/waker/users/ada/app/")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        return r.text


@pytest.mark.timeout(900)
def test_on_wake_restarts_a_spawned_server_after_a_sleep(host: LocalHost, tmp_path: Path) -> None:
    root = tmp_path / "waker"
    root.mkdir()
    (root / "moorage.toml").write_text('[agent]\nname = "waker"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(AGENT)
    with Client(host.url, host.key) as sdk:
        sdk.deploy("waker", root)
        assert _page(host) == "served by the spawned server"  # the first start: on_wake ran for the app request
        assert sdk.invoke("waker", "count", user="ada")["reply"] == "1 not-in-a-turn"  # once, not again per turn
        sid = sdk.get_user("waker", "ada")["instance"]["sandbox_id"]

        sdk.sandbox_action(sid, "sleep")  # the process driver stops every process, the spawned server too
        assert _page(host) == "served by the spawned server"  # woken by the app request: on_wake ran first
        assert sdk.invoke("waker", "count", user="ada")["reply"] == "2 not-in-a-turn"

        sdk.sandbox_action(sid, "sleep")
        assert sdk.invoke("waker", "count", user="ada")["reply"] == "3 not-in-a-turn"  # woken by a turn: it too
        assert _page(host) == "served by the spawned server"


FAILING = '''
import os

async def on_wake(ctx):
    if not ctx.files.exists("failed-once"):
        ctx.files.write("failed-once", "yes")
        raise RuntimeError("the cache directory is missing")
    ctx.files.write("woke", "yes")

async def on_message(ctx, message):
    return ctx.files.read("woke")
'''


def test_a_turn_that_finds_on_wake_failing_says_so_and_the_next_runs_it_again(host: LocalHost, tmp_path: Path) -> None:
    from moorage.client import ServerError

    root = tmp_path / "failing"
    root.mkdir()
    (root / "moorage.toml").write_text('[agent]\nname = "failing"\nentry = "agent.py"\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(FAILING)
    with Client(host.url, host.key) as sdk:
        sdk.deploy("failing", root)
        with pytest.raises(ServerError) as failed:
            sdk.invoke("failing", "hi", user="ada")
        assert failed.value.code == "agent-error" and "on_wake raised RuntimeError" in failed.value.detail
        assert "the cache directory is missing" in failed.value.detail and "agent.py, line 7" in (failed.value.hint or "")
        assert sdk.invoke("failing", "hi", user="ada")["reply"] == "yes"
