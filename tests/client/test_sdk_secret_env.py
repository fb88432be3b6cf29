"""An agent's ``[agent.secrets] env`` secret reaches the processes it spawns while it is opted in; after the agent
opts out (a redeploy without it) or the secret is deleted, a process spawned later does not get it, and one spawned
before keeps the environment it was started with (a process's environment cannot be changed from outside). Its
``on_wake`` gets it whatever woke the sandbox, an app request too; a command run through the sandbox API does not."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost

AGENT = '''
import os

async def on_message(ctx, message):
    verb, _, name = message.partition(" ")
    if verb == "env":
        return os.environ.get("TOKEN", "<absent>")
    if verb == "spawn":  # writes what it was started with, now and again every 0.1 s while it runs
        await ctx.spawn(["sh", "-c", 'while :; do echo "${TOKEN:-<absent>}" > %s.tmp; mv %s.tmp %s; sleep 0.1; done'
                         % (name, name, name)])
        return "spawned"
    if verb == "read":
        path = os.path.join(ctx.files.root, name)
        return open(path).read().strip() if os.path.exists(path) else "<not yet>"
    return "?"
'''


def _agent(root: Path, opted_in: bool) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "envy"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                                       + ('[agent.secrets]\nenv = ["TOKEN"]\n' if opted_in else ""))
    (root / "agent.py").write_text(AGENT)
    return root


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    server = LocalHost("up", tmp_path_factory.mktemp("secret-env") / "data", {"MOORAGE_LOG_LEVEL": "warning"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def _read(sdk: Client, name: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        seen = sdk.invoke("envy", f"read {name}", user="ada")["reply"]
        if seen != "<not yet>":
            return seen
        assert time.monotonic() < deadline, f"{name} was never written"
        time.sleep(0.2)


def _sandbox(sdk: Client) -> str:
    return sdk.get_user("envy", "ada")["instance"]["sandbox_id"]


def test_opting_out_keeps_the_secret_from_processes_spawned_after(host: LocalHost, tmp_path: Path) -> None:
    with Client(host.url, host.key) as sdk:
        sdk.deploy("envy", _agent(tmp_path / "in", True))
        sdk.set_secret("envy", "TOKEN", "tok-1")
        assert sdk.invoke("envy", "env", user="ada")["reply"] == "tok-1"
        sdk.invoke("envy", "spawn early", user="ada")
        assert _read(sdk, "early") == "tok-1"
        sandbox = _sandbox(sdk)

        sdk.deploy("envy", _agent(tmp_path / "out", False))  # the agent opts out
        assert sdk.invoke("envy", "env", user="ada")["reply"] == "<absent>"
        sdk.invoke("envy", "spawn late", user="ada")
        assert _read(sdk, "late") == "<absent>"
        if _sandbox(sdk) == sandbox:  # the same processes went on: the one spawned before kept its environment
            assert _read(sdk, "early") == "tok-1"


def test_a_deleted_secret_is_not_handed_to_processes_spawned_after(host: LocalHost, tmp_path: Path) -> None:
    with Client(host.url, host.key) as sdk:
        sdk.deploy("envy", _agent(tmp_path / "in", True))
        sdk.set_secret("envy", "TOKEN", "tok-2")
        sdk.invoke("envy", "spawn before", user="ada")
        assert _read(sdk, "before") == "tok-2"
        sdk.delete_secret("envy", "TOKEN")
        assert sdk.invoke("envy", "env", user="ada")["reply"] == "<absent>"
        sdk.invoke("envy", "spawn after", user="ada")
        assert _read(sdk, "after") == "<absent>"
        assert _read(sdk, "before") == "tok-2"  # started with it: keeps it


WAKER = '''
import os, sys

async def on_wake(ctx):  # the page says what on_wake found in its environment; the server it starts has the same
    ctx.files.write("site/index.html", os.environ.get("TOKEN", "<absent>"))
    await ctx.spawn([sys.executable, "-m", "http.server", "8080", "--bind", "127.0.0.1",
                     "--directory", os.path.join(ctx.files.root, "site")], log="server.log")

async def on_message(ctx, message):
    return os.environ.get("TOKEN", "<absent>")
'''


def _page(host: LocalHost, user: str) -> str:
    with host.client(host.key) as c:
        deadline = time.monotonic() + 30
        while True:
            r = c.get(f"/v1/agents/wakeenv/users/{user}/app/")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        return r.text


def test_on_wake_run_for_an_app_request_gets_the_secrets_a_turn_gets(host: LocalHost, tmp_path: Path) -> None:
    root = tmp_path / "wakeenv"
    root.mkdir()
    (root / "moorage.toml").write_text('[agent]\nname = "wakeenv"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n[agent.secrets]\nenv = ["TOKEN"]\n')
    (root / "agent.py").write_text(WAKER)
    with Client(host.url, host.key) as sdk:
        sdk.deploy("wakeenv", root)
        sdk.set_secret("wakeenv", "TOKEN", "tok-app")
        assert _page(host, "cy") == "tok-app"  # the app request started the instance: on_wake ran with it
        sid = sdk.get_user("wakeenv", "cy")["instance"]["sandbox_id"]
        sdk.set_secret("wakeenv", "TOKEN", "tok-woken")
        sdk.sandbox_action(sid, "sleep")  # the process driver stops every process
        assert _page(host, "cy") == "tok-woken"  # woken by the app request: the current value, as a turn gets it
        assert sdk.invoke("wakeenv", "env", user="cy")["reply"] == "tok-woken"
        # A command through the sandbox API is the caller's, outside any turn: only the env its request passes.
        said = sdk.exec(sid, ["sh", "-c", 'echo "${TOKEN:-<absent>}"'])
        assert said["stdout"].strip() == "<absent>", said
        assert sdk.exec(sid, ["sh", "-c", 'echo "$TOKEN"'], env={"TOKEN": "given"})["stdout"].strip() == "given"
