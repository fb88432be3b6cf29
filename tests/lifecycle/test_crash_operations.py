"""`moorage up` SIGKILLed inside operations a user starts through the HTTP API, then started again on the same data
dir (tests/lifecycle/crash_up.py kills it at a chosen call): nothing stays in an in-between state, nothing
half-made is left, nothing that must happen once happens twice."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage.devservices.postgres import free_port
from tests.api.conftest import agent_archive
from tests.lifecycle.crash_up import Up
from tests.runtime.test_mustshow_crash import stop_sandboxes

GZ = {"content-type": "application/gzip"}


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path / "data", free_port())
    yield u
    u.stop()
    stop_sandboxes(u.data)


def _in_background(fn: Any) -> list[Any]:
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the host is killed under it
            out.append(e)

    threading.Thread(target=go, daemon=True).start()
    return out


@pytest.mark.parametrize("crash_at, after", [
    ("moorage.runtime.templates:push_and_load", False),  # the builder sandbox is up, the code not loaded
    ("moorage.sandbox.process:ProcessDriver.make_template", True),  # the template is made, the deploy not ready
])
def test_killed_while_a_deploy_builds_the_deploy_ends_failed_and_the_live_one_serves(
        up: Up, tmp_path: Path, crash_at: str, after: bool) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"
    up.stop()
    up.start(crash_at, after=after)
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"),
                                      headers=GZ))
        assert up.died()
    up.start()
    with up.client() as c:
        deps = c.get("/v1/agents/echo/deployments").json()["data"]
        assert [d["status"] for d in deps] == ["ready", "failed"]
        assert c.get("/v1/agents/echo").json()["live_deployment"] == deps[0]["id"]
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"
        # Nothing of the cut-short build is left running or on disk: its builder sandbox is gone.
        sandboxes = sorted(p.name for p in (up.data / "sandboxes").iterdir())
        assert not [s for s in sandboxes if s.startswith("tpl-")], sandboxes
        r = c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"), headers=GZ)
        assert r.status_code == 201, r.text
        assert [d["status"] for d in c.get("/v1/agents/echo/deployments").json()["data"]] == ["ready", "failed", "ready"]
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo2: hi"
