"""An agent's app where the relay meets its limits and its records, on the process driver: a guest relay holding all
the connections it allows, a share link's requests in the tenant's traces, and a caller's close that has no code."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import httpx
import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from tests.app.test_app_edges import World, owner, serve_world

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

#: The guest relay's cap on connections open to one app (guest/app_relay.py MAX_CONNECTIONS).
GUEST_MAX_CONNECTIONS = 64


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    # The host's own cap on an app's WebSockets above the guest's, so that the guest's is the one reached.
    async with serve_world(tmp_path_factory.mktemp("app-limits"), app_ws_max_sockets=GUEST_MAX_CONNECTIONS + 8) as w:
        yield w


def _key(w: World) -> dict[str, str]:
    return {"Authorization": f"Bearer {w.acme}"}


async def test_a_relay_full_of_connections_is_a_503_that_says_the_app_is_busy(world: World) -> None:
    async with contextlib.AsyncExitStack() as held:
        sockets: list[ClientConnection] = []
        for _ in range(GUEST_MAX_CONNECTIONS):
            ws = await held.enter_async_context(owner(world, "ws"))
            await ws.send("x")
            assert await ws.recv() == "x"
            sockets.append(ws)
        with pytest.raises(InvalidStatus) as e:
            async with owner(world, "ws"):
                pass
        response = e.value.response
        assert response.status_code == 503, response.body
        problem = json.loads(response.body)
        assert problem["detail"] == "the agent's app has too many open connections", problem
        assert response.headers["Retry-After"] == "1"
        async with httpx.AsyncClient(base_url=world.http, headers=_key(world), timeout=60) as c:
            r = await c.get("/v1/agents/edge/users/ada/app/page")
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["detail"] == "the agent's app has too many open connections"
        assert all(ws.close_code is None for ws in sockets)  # the full relay closed none of those it holds
    async with owner(world, "ws") as ws:  # once they are closed, the app takes connections again
        await ws.send("y")
        assert await ws.recv() == "y"


async def test_a_share_links_requests_are_in_the_tenants_traces_without_its_token(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.http, headers=_key(world), timeout=60) as c:
        link = (await c.post("/v1/agents/edge/users/ada/share-links", json={"ttl_s": 600})).json()
        async with httpx.AsyncClient(base_url=world.http, timeout=60) as browser:
            r = await browser.get(link["url"] + "traced?q=1")
            assert r.json() == {"method": "GET", "path": "/traced?q=1"}
            trace_id = r.headers["x-trace-id"]
        trace = await c.get(f"/v1/traces/{trace_id}")
        assert trace.status_code == 200, trace.text
        spans = trace.json()["spans"]
        route = "/v1/shared/{token}/{path:path}"
        (span,) = [s for s in spans if s["attrs"].get("http.route") == route]
        assert span["name"] == "GET " + route and span["parent_id"] is None and span["status"] != "error"
        assert {k: span["attrs"][k] for k in ("http.method", "http.status_code", "moorage.agent", "moorage.user")} == {
            "http.method": "GET", "http.status_code": 200, "moorage.agent": "edge", "moorage.user": "ada"}
        recent = (await c.get("/v1/traces", params={"limit": 200})).json()
    token = link["token"]
    assert token not in json.dumps(spans) and token not in json.dumps(recent)


async def test_a_callers_close_without_a_code_reaches_the_app_without_one(world: World) -> None:
    async with owner(world, "ws") as ws:
        await ws.send("x")
        assert await ws.recv() == "x"
        no_code: Any = None  # an empty close frame: RFC 6455 says its code is 1005, which is never sent
        await ws.close(no_code)
    async with owner(world, "ws") as ws:
        await ws.send("last")
        # The app got a close frame with an empty payload, not one that says 1000.
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["close"] == []
