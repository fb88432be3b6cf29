"""An agent's app at its edges, on the process driver (nothing here is VM-specific): an app that never answers the
WebSocket upgrade, close reasons at their longest, fragmented messages, and what a page's scripts need over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import pytest_asyncio
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moorage.api import create_app
from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.store import open_store
from tests.api.conftest import free_port
from tests.app.wsapp import agent_py
from tests.conftest import stop_all_sandboxes

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

APP_TIMEOUT_S = 3

# A stdlib server on the app's port: plain HTTP answers what it was asked (as JSON), /upload refuses any body unread, a
# WebSocket echoes and obeys a few commands, and /silent takes the connection and never answers.
AGENT = agent_py(r'''
import json, os, struct, time

LAST = {}


class Handler(AppHandler):
    def respond(self):
        target, headers = self.target, self.headers
        if target.startswith("/silent"):
            time.sleep(600)
            return
        if target.startswith("/moved"):  # a redirect made absolute from the Host it was sent, as frameworks do
            self.wfile.write(b"HTTP/1.1 307 Moved\r\nLocation: http://" + headers["host"].encode() + b"/landed/?x=1\r\n"
                             b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            return
        origin = headers.get("origin")
        if target.startswith("/same-origin") and origin is not None and origin != "http://" + headers["host"]:
            # Tornado's and engine.io's default check: a browser's request from another origin is refused.
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        if target.startswith("/upload"):  # refused before reading the body, as a size check would
            self.wfile.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!")
            return
        if not self.upgrade():
            body = json.dumps({"method": self.method, "path": target}).encode()
            allowed = (origin or "*").encode()  # the origin it saw, reflected as Flask-CORS does
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Access-Control-Allow-Origin: %s\r\nAccess-Control-Allow-Methods: GET, POST\r\n"
                             b"Access-Control-Allow-Headers: content-type\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (allowed, len(body)) + body)
            return
        # Headers of its own on the 101 (a cookie too, which no caller gets), and chat.v1 when offered.
        chosen = b"Sec-WebSocket-Protocol: chat.v1\r\n" if "chat.v1" in self.offered() else b""
        self.switch(b"X-App-Header: from-app\r\nSet-Cookie: s=1\r\n" + chosen)
        self.serve_socket()

    def serve_socket(self):
        while True:
            opcode, data = self.read_frame()
            if opcode is None:
                return
            if opcode == 8:
                LAST["close"] = [struct.unpack("!H", data[:2])[0], data[2:].decode()] if data else []
                self.frame(8, data[:2])
                return
            if opcode == 10:
                LAST["pong"] = data.decode()
            elif opcode == 1 and data == b"last":
                self.frame(1, json.dumps(LAST).encode())
            elif opcode == 1 and data.startswith(b"close "):  # close with this reason
                self.frame(8, struct.pack("!H", 4000) + data[6:])
                self.read_frame()
                return
            elif opcode == 1 and data == b"fragments":  # one message in three frames, a ping between them
                self.frame(1, b"ab", fin=False)
                self.frame(9, b"app-ping")
                self.frame(0, b"cd", fin=False)
                self.frame(0, b"ef")
            elif opcode == 1 and data == b"crash":  # the app takes the agent's process down with it
                os._exit(3)
            elif opcode == 1 and data.startswith(b"stall "):  # reads nothing for a while
                time.sleep(float(data[6:]))
            elif opcode in (1, 2):
                self.frame(opcode, data)


serve(Handler)


async def on_message(ctx, message):
    return "ok"
''')


def _archive(tmp: Path, name: str = "edge", code: str = AGENT, toml: str = "") -> bytes:
    root = tmp / name
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n' + toml)
    (root / "agent.py").write_text(textwrap.dedent(code))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


class World:
    http: str
    ws: str
    acme: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    async with serve_world(tmp_path_factory.mktemp("app-edges")) as w:
        yield w


@contextlib.asynccontextmanager
async def serve_world(tmp: Path, **config: Any) -> AsyncIterator[World]:
    """A host on the process driver serving the edge app (and a "down" one), with ``config`` over the defaults."""
    from tests.sandbox.conftest import DRIVER_FACTORIES

    cfg = Config(data_dir=tmp / "data", sandbox_driver="process", app_timeout_s=APP_TIMEOUT_S, **config)
    store = open_store(cfg)
    acme = store.operator.create_tenant("acme")[1].secret
    driver = DRIVER_FACTORIES["process"](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    port = free_port()
    # As `moorage up` runs it (cli/up.py).
    server = uvicorn.Server(uvicorn.Config(create_app(rt, cfg), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", ws_max_size=cfg.app_ws_max_message_bytes))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    w = World()
    w.http, w.ws, w.acme = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", acme
    async with httpx.AsyncClient(base_url=w.http, headers={"Authorization": f"Bearer {acme}"}, timeout=300) as c:
        r = await c.post("/v1/agents/edge/deployments", content=_archive(tmp), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/agents/edge/invoke", json={"message": "hi", "user": "ada"})
        assert r.json()["reply"] == "ok", r.text
        # An agent that declares its port and starts nothing on it: its app is down.
        r = await c.post("/v1/agents/down/deployments", content=_archive(tmp, "down", "async def on_message(ctx, m):\n"
                                                                         "    return 'ok'\n"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
    try:
        yield w
    finally:
        server.should_exit = True
        await task
        await rt.aclose()
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


def owner(w: World, path: str) -> Any:
    return connect(f"{w.ws}/v1/agents/edge/users/ada/app/{path}", additional_headers={"Authorization": f"Bearer {w.acme}"},
                   open_timeout=120)


async def test_an_app_that_never_answers_the_upgrade_is_a_502_after_app_timeout_s(world: World) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidStatus) as e:
        async with owner(world, "silent"):
            pass
    took = time.monotonic() - started
    assert e.value.response.status_code == 502
    assert "took too long" in json.loads(e.value.response.body)["detail"]
    # app_timeout_s, not the guest relay's own 25 s wait for bytes.
    assert took < APP_TIMEOUT_S + 4, f"the refusal took {took:.1f}s"
    async with owner(world, "ws") as ws:  # nothing was left holding the instance
        await ws.send("x")
        assert await ws.recv() == "x"


async def test_closes_keep_their_whole_reason_and_fragmented_messages_arrive_whole(world: World) -> None:
    longest = "r" * 123  # the most a close frame can carry
    async with owner(world, "ws") as ws:
        await ws.send("fragments")
        assert await ws.recv() == "abcdef"  # the app's ping between the fragments was answered, not relayed
        await ws.send("last")
        assert json.loads(await ws.recv())["pong"] == "app-ping"
        await ws.send("close " + longest)
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 30)
        assert e.value.rcvd is not None and (e.value.rcvd.code, e.value.rcvd.reason) == (4000, longest)
    reason = "é" * 61  # 122 bytes
    async with owner(world, "ws") as ws:
        await ws.close(4001, reason)
    # The close reaches the app on its own connection: another one may ask before it has (a loaded host).
    deadline = time.monotonic() + 30
    async with owner(world, "ws") as ws:
        while True:
            await ws.send("last")
            seen = json.loads(await ws.recv()).get("close")
            if seen == [4001, reason] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert seen == [4001, reason]


async def test_the_apps_handshake_headers_reach_the_caller(world: World) -> None:
    async with connect(f"{world.ws}/v1/agents/edge/users/ada/app/ws", subprotocols=["other", "chat.v1"],
                       additional_headers={"Authorization": f"Bearer {world.acme}"}, open_timeout=120) as ws:
        assert ws.subprotocol == "chat.v1"
        headers = ws.response.headers
        assert headers.get_all("x-app-header") == ["from-app"], headers
        assert "set-cookie" not in headers and "x-moorage-served-by" not in headers, headers
        await ws.send("x")
        assert await ws.recv() == "x"


async def test_a_shared_pages_scripts_can_call_the_app_cross_origin(world: World) -> None:
    # The app's pages run in an opaque origin (the sandbox CSP), so a browser sends their fetches with
    # `Origin: null` and, for a JSON POST, asks first with a preflight OPTIONS: the app answers both.
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        link = (await c.post("/v1/agents/edge/users/ada/share-links", json={"ttl_s": 600})).json()
    async with httpx.AsyncClient(base_url=world.http, timeout=60) as browser:
        r = await browser.options(link["url"] + "api/items?x=1", headers={
            "Origin": "null", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200, r.text
        assert r.json() == {"method": "OPTIONS", "path": "/api/items?x=1"}
        assert r.headers["access-control-allow-origin"] == "null"
        assert r.headers["access-control-allow-headers"] == "content-type"
        r = await browser.post(link["url"] + "api/items", json={"name": "x"}, headers={"Origin": "null"})
        assert r.json() == {"method": "POST", "path": "/api/items"} and r.headers["access-control-allow-origin"] == "null"
    async with httpx.AsyncClient(base_url=world.http) as anonymous:  # the owner's route still needs a key
        assert (await anonymous.options("/v1/agents/edge/users/ada/app/api/items")).status_code == 401


async def test_an_app_that_stops_reading_closes_the_socket_with_1011_after_app_timeout_s(world: World) -> None:
    async with owner(world, "ws") as ws:
        await ws.send("stall 60")
        started = time.monotonic()

        async def flood() -> None:  # more than every socket buffer between the host and the app holds
            for _ in range(32):
                await ws.send(b"x" * (1 << 20))

        sending = asyncio.ensure_future(flood())
        try:
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), 60)
        finally:
            sending.cancel()
        took = time.monotonic() - started
    rcvd = e.value.rcvd
    # Not "went to sleep" (it did not), and not after the channel's own 35 s.
    assert rcvd is not None and (rcvd.code, rcvd.reason) == (1011, "the agent's app stopped reading the socket")
    assert took < APP_TIMEOUT_S + 10, f"closed after {took:.1f}s"
    async with owner(world, "ws") as ws:  # the instance is fine: the next socket works (another app thread)
        await ws.send("y")
        assert await ws.recv() == "y"


async def test_an_app_that_crashes_its_instance_is_not_reported_as_a_sleep(world: World) -> None:
    async with owner(world, "ws") as ws:
        await ws.send("crash")
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 60)
    rcvd = e.value.rcvd
    assert rcvd is not None and (rcvd.code, rcvd.reason) == (1011, "the agent's instance stopped")
    # The next socket brings the instance back. One that comes while the crashed process is still exiting gets a
    # 503 instance-stopped with Retry-After (was a 409 telling the caller to wake the sandbox): a client retries it.
    for _ in range(10):
        try:
            async with owner(world, "ws") as ws:
                await ws.send("y")
                assert await ws.recv() == "y"
            break
        except InvalidStatus as refused:
            assert refused.response.status_code == 503 and refused.response.headers["retry-after"] == "1"
            await asyncio.sleep(1)
    else:
        pytest.fail("the instance never came back after its app crashed")


async def test_a_redeploy_that_restarts_the_instance_closes_its_sockets_with_1012(world: World, tmp_path: Path) -> None:
    url = f"{world.ws}/v1/agents/redeployed/users/ada/app/ws"
    key = {"Authorization": f"Bearer {world.acme}"}
    async with httpx.AsyncClient(base_url=world.http, headers=key, timeout=300) as c:
        r = await c.post("/v1/agents/redeployed/deployments", content=_archive(tmp_path / "v1", "redeployed"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        async with connect(url, additional_headers=key, open_timeout=120) as ws:
            await ws.send("v1")
            assert await ws.recv() == "v1"
            # A new deployment whose sandboxes have another environment (a network of their own): the instance's
            # processes restart with it on its first load there, which this turn makes.
            r = await c.post("/v1/agents/redeployed/deployments", headers={"content-type": "application/gzip"},
                             content=_archive(tmp_path / "v2", "redeployed",
                                              toml='[agent.network]\nallow = ["http://api.test:9"]\n'))
            assert r.status_code == 201, r.text
            r = await c.post("/v1/agents/redeployed/invoke", json={"message": "hi", "user": "ada"})
            assert r.json()["reply"] == "ok", r.text
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), 60)
        rcvd = e.value.rcvd
        # Service restart, not a crash (1011): a client reconnects, and reaches the new deployment's app.
        assert rcvd is not None and (rcvd.code, rcvd.reason) == (1012, "the agent was redeployed; reconnect"), rcvd
    async with connect(url, additional_headers=key, open_timeout=120) as ws:
        await ws.send("v2")
        assert await ws.recv() == "v2"


async def test_an_app_that_refuses_an_upload_before_reading_it_is_heard(world: World) -> None:
    # The app answers 413 and closes with most of the body unread (which resets the connection): the caller gets
    # that answer, not a 502, however large the body.
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}, timeout=60) as c:
        for size in (1 << 10, 1 << 20, 8 << 20):
            r = await c.post("/v1/agents/edge/users/ada/app/upload", content=b"u" * size)
            assert (r.status_code, r.text) == (413, "too big!"), (size, r.text)
        r = await c.post("/v1/agents/edge/users/ada/app/other", content=b"u" * (8 << 20))  # a 200 given unread too
        assert r.json() == {"method": "POST", "path": "/other"}



async def test_an_app_that_stops_reading_a_request_is_a_502_after_app_timeout_s(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}, timeout=60) as c:
        started = time.monotonic()
        r = await c.post("/v1/agents/edge/users/ada/app/silent", content=b"u" * (12 << 20))  # more than buffers hold
        took = time.monotonic() - started
    assert r.status_code == 502 and r.json()["detail"] == "the agent's app stopped reading the request", r.text
    assert took < APP_TIMEOUT_S + 10, f"answered after {took:.1f}s"


async def test_a_redirect_to_the_apps_own_address_stays_inside_the_app(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        r = await c.get("/v1/agents/edge/users/ada/app/moved")
        assert r.status_code == 307 and r.headers["location"] == "/v1/agents/edge/users/ada/app/landed/?x=1"
        link = (await c.post("/v1/agents/edge/users/ada/share-links", json={"ttl_s": 600})).json()
    async with httpx.AsyncClient(base_url=world.http) as browser:
        r = await browser.get(link["url"] + "moved")
        assert r.status_code == 307 and r.headers["location"] == link["url"] + "landed/?x=1"
        r = await browser.get(link["url"] + "moved", follow_redirects=True)  # where a browser ends up
        assert r.status_code == 200 and r.json() == {"method": "GET", "path": "/landed/?x=1"}


async def test_a_browsers_socket_passes_the_apps_same_origin_check(world: World) -> None:
    # A page served through a share link runs in an opaque origin: its browser opens the socket with
    # `Origin: null`. The app sees its own origin, as it sees its own Host, so a same-origin check passes.
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        link = (await c.post("/v1/agents/edge/users/ada/share-links", json={"ttl_s": 600})).json()
    for origin in ("null", world.http):
        async with connect(world.ws + link["url"] + "same-origin", origin=origin, open_timeout=120) as ws:  # type: ignore[arg-type]
            await ws.send("z")
            assert await ws.recv() == "z"
    async with httpx.AsyncClient(base_url=world.http) as browser:  # and so does a page's fetch
        r = await browser.get(link["url"] + "same-origin", headers={"Origin": "null"})
        assert r.status_code == 200 and r.json() == {"method": "GET", "path": "/same-origin"}
        # An app that reflects the origin it saw in its CORS answer allows the browser's own.
        assert r.headers["access-control-allow-origin"] == "null"


async def test_the_redirect_to_the_apps_root_keeps_the_query(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        r = await c.get("/v1/agents/edge/users/ada/app?tab=2&q=a%20b")
        assert r.status_code == 308 and r.headers["location"] == "/v1/agents/edge/users/ada/app/?tab=2&q=a%20b"
        link = (await c.post("/v1/agents/edge/users/ada/share-links", json={"ttl_s": 600})).json()
    async with httpx.AsyncClient(base_url=world.http) as browser:
        r = await browser.get(link["url"].rstrip("/") + "?tab=2", follow_redirects=True)
        assert r.json() == {"method": "GET", "path": "/?tab=2"}


async def test_an_app_that_is_down_is_a_prompt_502_that_says_so(world: World) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidStatus) as e:
        async with connect(f"{world.ws}/v1/agents/down/users/ada/app/ws", open_timeout=120,
                           additional_headers={"Authorization": f"Bearer {world.acme}"}):
            pass
    assert e.value.response.status_code == 502
    assert json.loads(e.value.response.body)["detail"] == "the agent's app is not listening on port 8080"
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        r = await c.get("/v1/agents/down/users/ada/app/")
        assert r.status_code == 502 and r.json()["hint"] == "start a server on 127.0.0.1:8080 in the sandbox"
    assert time.monotonic() - started < 30  # the first of them started the instance
