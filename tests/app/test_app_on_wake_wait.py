"""An app request waits for the agent's ``on_wake`` at most the agent's ``[agent.limits] turn_timeout_s`` (or the
host's ``app_timeout_s`` if shorter), then is a 504 ``on-wake-timeout`` naming it; the run goes on and the next request
waits for the same one. Before, the host's channel gave up after 15 s with a 504 that named nothing ("report trace id
... to the operator"), and so did every request after it while on_wake ran (process driver)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
import uvicorn

from moorage.api import create_app
from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.store import open_store
from tests.api.conftest import free_port
from tests.app.test_app_edges import _archive
from tests.app.wsapp import agent_py
from tests.conftest import stop_all_sandboxes

pytestmark = pytest.mark.timeout(300)

TURN_TIMEOUT_S = 3
LIMITS = f"[agent.limits]\nturn_timeout_s = {TURN_TIMEOUT_S}\n"

# The app's server starts with the module; on_wake takes its time (SLOW s, counted in wakes.log), or never returns.
AGENT = agent_py(r'''
import asyncio, os

class Handler(AppHandler):
    def respond(self):
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

serve(Handler)

async def on_wake(ctx):
    with open(os.path.join(ctx.files.root, "wakes.log"), "a") as f:
        f.write("wake\n")
    await asyncio.sleep(SLOW)

async def on_message(ctx, message):
    return str(ctx.files.read("wakes.log").count("wake"))
''')


@contextlib.asynccontextmanager
async def host(tmp: Path) -> AsyncIterator[httpx.AsyncClient]:
    from tests.sandbox.conftest import DRIVER_FACTORIES

    cfg = Config(data_dir=tmp / "data", sandbox_driver="process")  # app_timeout_s 60: the agent's limit is shorter
    store = open_store(cfg)
    key = store.operator.create_tenant("acme")[1].secret
    driver = DRIVER_FACTORIES["process"](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(rt, cfg), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            yield c
    finally:
        server.should_exit = True
        await task
        await rt.aclose()
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


async def deploy(c: httpx.AsyncClient, tmp: Path, name: str, slow_s: float) -> None:
    code = AGENT.replace("SLOW", repr(slow_s))
    r = await c.post(f"/v1/agents/{name}/deployments", content=_archive(tmp, name, code, LIMITS),
                     headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text


async def timed_get(c: httpx.AsyncClient, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = await c.get(path)
    return r, time.monotonic() - started


async def test_an_on_wake_slower_than_the_agents_limit_is_a_504_and_the_next_request_gets_its_run(tmp_path: Path) -> None:
    async with host(tmp_path) as c:
        # 4.5 s: 1.5 s past the first request's 3 s limit, and 1.5 s for the next one to wait (at 6 s the next one
        # waited all 3 s of its limit, no margin: a CI run once saw it time out too).
        await deploy(c, tmp_path, "slow", 4.5)
        r, took = await timed_get(c, "/v1/agents/slow/users/ada/app/")
        assert r.status_code == 504, r.text
        problem = r.json()
        assert problem["type"].endswith("/on-wake-timeout")
        assert problem["detail"] == f"the agent's on_wake did not return within {TURN_TIMEOUT_S} s, so its app was " \
                                    "not reached"
        assert "ctx.spawn" in problem["hint"] and "turn_timeout_s" in problem["hint"]
        assert TURN_TIMEOUT_S <= took < TURN_TIMEOUT_S + 9, took  # the first also makes the instance
        # The run went on: the next request waits for that one (not a new one) and is served when it returns.
        r, took = await timed_get(c, "/v1/agents/slow/users/ada/app/")
        assert (r.status_code, r.text) == (200, "ok")
        r = await c.post("/v1/agents/slow/invoke", json={"message": "wakes?", "user": "ada"})
        assert r.json()["reply"] == "1", r.text  # once, for every request and the turn


async def test_an_on_wake_that_never_returns_holds_each_app_request_only_the_agents_limit(tmp_path: Path) -> None:
    async with host(tmp_path) as c:
        await deploy(c, tmp_path, "stuck", 3600.0)
        for _ in range(2):
            r, took = await timed_get(c, "/v1/agents/stuck/users/bo/app/")
            assert r.status_code == 504 and r.json()["type"].endswith("/on-wake-timeout"), r.text
            assert TURN_TIMEOUT_S <= took < TURN_TIMEOUT_S + 9, took  # the first also makes the instance


async def test_a_turn_that_finds_on_wake_hanging_says_on_wake_is_what_did_not_return(tmp_path: Path) -> None:
    """A turn whose time ran out in the agent's on_wake answered a plain 504 turn-timeout, which sent its developer
    looking in the turn's handler; it now says on_wake did not return, as an app request in the same case does."""
    async with host(tmp_path) as c:
        await deploy(c, tmp_path, "stuck", 3600.0)
        r = await c.post("/v1/agents/stuck/invoke", json={"message": "hi", "user": "cy"})
        assert r.status_code == 504, r.text
        problem = r.json()
        assert problem["type"].endswith("/on-wake-timeout"), problem
        assert problem["detail"] == f"the agent's on_wake did not return within the turn's {TURN_TIMEOUT_S} s, so " \
                                    "the turn's handler was not reached", problem
        assert "ctx.spawn" in problem["hint"] and "turn_timeout_s" in problem["hint"], problem
        # An on_wake that returns in time: the turn is served after it (one that times out in its own handler is
        # still a plain turn-timeout: tests/runtime/test_agent_failure_modes.py).
        await deploy(c, tmp_path, "quick", 0.0)
        r = await c.post("/v1/agents/quick/invoke", json={"message": "hi", "user": "cy"})
        assert r.status_code == 200 and r.json()["reply"] == "1", r.text
