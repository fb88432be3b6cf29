"""WebSockets to an agent's own app, end to end on both drivers with a real client (``websockets``): messages
both ways through the owner's route and share links, subprotocols, closes from either side, caps, the socket
closed when the instance sleeps (which it does not prevent), and nothing across tenants, users or dead links."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import pytest_asyncio
import uvicorn
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moorage.api import create_app
from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.store import Scope, open_store
from tests.api.conftest import free_port
from tests.app.wsapp import agent_py
from tests.conftest import stop_all_sandboxes

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

MAX_MESSAGE = 64 << 10
MAX_SOCKETS = 4

# A WebSocket server written with the standard library only (the sandbox's Python has nothing else), started
# by the agent module in a thread; plain HTTP on the same port. What it saw is kept for the test to ask about.
WS_AGENT = agent_py(r'''
import json, struct

NOTE = "/work/note.txt"
SEEN = "/work/ws-seen.json"
FLOODED = [0]  # how many messages of the last flood the app has written so far


def _note():
    try:
        return open(NOTE).read()
    except OSError:
        return "(none)"


def _remember(**kv):
    try:
        seen = json.load(open(SEEN))
    except (OSError, ValueError):
        seen = {}
    seen.update(kv)
    with open(SEEN, "w") as f:
        json.dump(seen, f)


class Handler(AppHandler):
    def respond(self):
        headers = self.headers
        if not self.upgrade():
            body = ("<p>note: %s</p>" % _note()).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n" % len(body) + body)
            return
        if self.target.startswith("/ws/refuse"):
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno")
            return
        self.switch(b"Sec-WebSocket-Protocol: chat.v1\r\n" if "chat.v1" in self.offered() else b"")
        self.seen = {"path": self.target, "auth": headers.get("authorization"), "cookie": headers.get("cookie"),
                     "prefix": headers.get("x-forwarded-prefix"), "custom": headers.get("x-custom")}
        self.serve_socket()

    def serve_socket(self):
        while True:
            opcode, data = self.read_frame()
            if opcode is None:
                _remember(last_close="eof")
                return
            if opcode == 8:  # close: answer it and remember what the client said
                code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else None
                _remember(last_close=code)
                self.frame(8, data[:2])
                return
            if opcode == 9:
                self.frame(10, data)
                continue
            if opcode == 2:
                self.frame(2, data)
                continue
            text = data.decode()
            if text == "seen":
                self.frame(1, json.dumps(self.seen).encode())
            elif text == "note":
                self.frame(1, _note().encode())
            elif text == "last-close":
                try:
                    self.frame(1, json.dumps(json.load(open(SEEN)).get("last_close")).encode())
                except (OSError, ValueError):
                    self.frame(1, b"null")
            elif text.startswith("push "):
                for i in range(int(text[5:])):
                    self.frame(1, ("n=%d" % i).encode())
            elif text.startswith("flood "):  # n messages of size bytes, as fast as the socket takes them
                n, size = map(int, text[6:].split())
                for i in range(n):
                    self.frame(2, i.to_bytes(4, "big") + b"f" * (size - 4))
                    FLOODED[0] = i + 1
            elif text == "flooded":
                self.frame(1, str(FLOODED[0]).encode())
            elif text.startswith("big "):
                self.frame(2, b"b" * int(text[4:]))
            elif text == "close":
                self.frame(8, struct.pack("!H", 4000) + b"bye")
                self.read_frame()
                return
            else:
                self.frame(1, data)


serve(Handler)


async def on_message(ctx, message):
    with open(NOTE, "w") as f:
        f.write(message)
    return "noted"
''')


def _archive(tmp: Path) -> bytes:
    root = tmp / "ws"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "ws"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(WS_AGENT))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


class World:
    http: str
    ws: str
    runtime: Runtime
    acme: str
    globex: str
    store: Any


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["process", "microvm"])
async def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    from tests.sandbox.conftest import DRIVER_FACTORIES

    tmp = tmp_path_factory.mktemp(f"appsocket-{request.param}")
    cfg = Config(data_dir=tmp / "data", sandbox_driver=request.param, app_ws_max_message_bytes=MAX_MESSAGE,
                 app_ws_max_sockets=MAX_SOCKETS)
    store = open_store(cfg)
    acme = store.operator.create_tenant("acme")[1].secret
    globex = store.operator.create_tenant("globex")[1].secret
    driver = DRIVER_FACTORIES[request.param](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    app = create_app(rt, cfg)
    port = free_port()
    # As `moorage up` runs it (cli/up.py): the server itself refuses a caller's message over the cap.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           ws_max_size=cfg.app_ws_max_message_bytes))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    w = World()
    w.http, w.ws, w.runtime, w.acme, w.globex, w.store = (f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", rt,
                                                           acme, globex, store)
    async with httpx.AsyncClient(base_url=w.http, headers={"Authorization": f"Bearer {acme}"}, timeout=300) as c:
        r = await c.post("/v1/agents/ws/deployments", content=_archive(tmp), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for user, note in (("ada", "ada-only"), ("bob", "bob-only")):
            r = await c.post("/v1/agents/ws/invoke", json={"message": note, "user": user})
            assert r.json()["reply"] == "noted", r.text
    try:
        yield w
    finally:
        server.should_exit = True
        await task
        await rt.aclose()  # its background work ends before what it uses closes
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


def owner(w: World, user: str, path: str = "ws/echo", key: str | None = None, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {key or w.acme}"} if key != "" else {}
    return connect(f"{w.ws}/v1/agents/ws/users/{user}/app/{path}", additional_headers={**headers, **kw.pop("headers", {})},
                   open_timeout=120, **kw)


async def refused(url: str, headers: dict[str, str] | None = None) -> int:
    with pytest.raises(InvalidStatus) as e:
        async with connect(url, additional_headers=headers or {}, open_timeout=120):
            pass
    return e.value.response.status_code


async def closed_with(ws: ClientConnection) -> tuple[int | None, str]:
    with pytest.raises(ConnectionClosed) as e:
        for _ in range(100):
            await asyncio.wait_for(ws.recv(), 60)
    rcvd = e.value.rcvd
    return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")


async def test_owner_socket_relays_both_ways(world: World) -> None:
    async with owner(world, "ada", "ws/echo%20x?q=1", subprotocols=["chat.v1"],
                     headers={"X-Custom": "kept", "Cookie": "k=v"}) as ws:
        assert ws.subprotocol == "chat.v1"
        await ws.send("hello")
        assert await ws.recv() == "hello"
        blob = bytes(range(256)) * 200  # 50 KiB, under the cap, in several relay chunks
        await ws.send(blob)
        assert await ws.recv() == blob
        await ws.send("note")
        assert await ws.recv() == "ada-only"  # ada's own sandbox
        # The app sees its own path and query and the caller's headers, never the key or cookies.
        await ws.send("seen")
        assert json.loads(await ws.recv()) == {"path": "/ws/echo%20x?q=1", "auth": None, "cookie": None,
                                               "prefix": "/v1/agents/ws/users/ada/app", "custom": "kept"}
        # The app talks first, many messages in order, while the client reads them as it likes.
        await ws.send("push 200")
        assert [await ws.recv() for _ in range(200)] == [f"n={i}" for i in range(200)]
        await asyncio.wait_for(await ws.ping(), 30)
        # The app closes: the caller gets its code and reason.
        await ws.send("close")
        assert await closed_with(ws) == (4000, "bye")
    # The caller closes: the app hears a WebSocket close with the caller's code.
    async with owner(world, "ada") as ws:
        await ws.send("x")
        assert await ws.recv() == "x"
        await ws.close(4001, "done")
    async with owner(world, "ada") as ws:
        for _ in range(50):
            await ws.send("last-close")
            if json.loads(await ws.recv()) == 4001:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the app never heard the caller's close")
    # The same app still serves plain HTTP.
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        r = await c.get("/v1/agents/ws/users/bob/app/")
        assert r.status_code == 200 and r.text == "<p>note: bob-only</p>"


async def test_other_tenants_users_and_anonymous_cannot_open_a_socket(world: World) -> None:
    url = f"{world.ws}/v1/agents/ws/users/ada/app/ws/echo"
    assert await refused(url, {"Authorization": f"Bearer {world.globex}"}) == 404
    assert await refused(url) == 401
    assert await refused(f"{world.ws}/v1/agents/ws/users/ada/app") == 401
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        bob_token = (await c.post("/v1/agents/ws/users/bob/tokens", json={})).json()["token"]
    assert await refused(url, {"Authorization": f"Bearer {bob_token}"}) == 403
    async with connect(f"{world.ws}/v1/agents/ws/users/bob/app/ws/echo",
                       additional_headers={"Authorization": f"Bearer {bob_token}"}, open_timeout=120) as ws:
        await ws.send("note")
        assert await ws.recv() == "bob-only"


async def test_share_links_open_a_socket_until_expiry_or_revocation(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
        link = (await c.post("/v1/agents/ws/users/ada/share-links", json={"ttl_s": 3600})).json()
        short = (await c.post("/v1/agents/ws/users/ada/share-links", json={"ttl_s": 1})).json()
    base = world.ws + link["url"]
    async with connect(base + "ws/echo", open_timeout=120) as ws:
        await ws.send("note")
        assert await ws.recv() == "ada-only"
        await ws.send("seen")
        assert json.loads(await ws.recv())["prefix"] == link["url"].rstrip("/")
    async with connect(base.rstrip("/"), open_timeout=120) as ws:  # the app's root, no trailing slash
        await ws.send("root")
        assert await ws.recv() == "root"
    # A link is no key for the owner's route; altered, expired or revoked links are the same 404.
    assert await refused(f"{world.ws}/v1/agents/ws/users/ada/app/ws", {"Authorization": f"Bearer {link['token']}"}) == 401
    tenant, link_id, expires, kid, mac = link["token"].split(".")
    globex_tenant = world.store.authenticate(world.globex).tenant_id
    for forged in (f"{globex_tenant}.{link_id}.{expires}.{kid}.{mac}", f"{tenant}.{link_id}.{int(expires) + 99}.{kid}.{mac}",
                   link["token"] + "x"):
        assert await refused(f"{world.ws}/v1/shared/{forged}/ws") == 404
    await asyncio.sleep(1.2)
    assert await refused(world.ws + short["url"] + "ws") == 404
    async with connect(base + "ws/echo", open_timeout=120) as open_before_revocation:
        async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.acme}"}) as c:
            assert (await c.delete(f"/v1/agents/ws/users/ada/share-links/{link['id']}")).status_code == 200
        assert await refused(base + "ws/echo") == 404
        async with httpx.AsyncClient(base_url=world.http, headers={"Authorization": f"Bearer {world.globex}"}) as other:
            r = await other.post("/v1/agents/ws/users/ada/share-links", json={"ttl_s": 60})
            assert r.status_code == 404
        # A socket opened before the revocation is not cut at once (at the next check of its link, within 5 s:
        # tests/api/test_enduser_hostile_ws.py).
        await open_before_revocation.send("still")
        assert await open_before_revocation.recv() == "still"


async def test_sleep_closes_the_socket_and_the_next_one_wakes_the_instance(world: World) -> None:
    rt = world.runtime
    ts = world.store.tenant(world.store.authenticate(world.acme))
    scope = Scope.for_user("ws", "bob")
    async with owner(world, "bob") as ws:
        await ws.send("note")
        assert await ws.recv() == "bob-only"
        # Its messages are activity for the instance's idle policy, as turns are.
        activity = rt.instances.live(ts, scope).activity
        before = (activity.turns, activity.idle_since)
        await ws.send("note")
        assert await ws.recv() == "bob-only"
        assert activity.turns > before[0] and activity.idle_since > before[1] and not activity.busy
        # An open socket does not keep the instance awake: its lifecycle may sleep it, and the socket then ends.
        assert await rt.instances.sleep(ts, scope)
        assert await closed_with(ws) == (1001, "the agent's instance went to sleep")
    assert ts.sandboxes.for_scope(scope).state == "sleeping"
    async with owner(world, "bob") as ws:
        await ws.send("note")
        assert await ws.recv() == "bob-only"
    assert ts.sandboxes.for_scope(scope).state == "running"


async def test_messages_and_sockets_are_capped(world: World) -> None:
    # A caller's message over app_ws_max_message_bytes closes the socket (1009) instead of reaching the app.
    async with owner(world, "ada") as ws:
        await ws.send(b"x" * MAX_MESSAGE)  # the cap itself passes
        assert len(await ws.recv()) == MAX_MESSAGE
        await ws.send(b"x" * (MAX_MESSAGE + 1))
        code, reason = await closed_with(ws)
        assert code == 1009 and f"{MAX_MESSAGE} bytes" in reason, reason
    # So does an app's (the host stops reading it at the cap).
    async with owner(world, "ada") as ws:
        await ws.send(f"big {MAX_MESSAGE - 100}")
        assert len(await ws.recv()) == MAX_MESSAGE - 100
        await ws.send(f"big {4 * MAX_MESSAGE}")
        code, reason = await closed_with(ws)
        assert code == 1011 and "over" in reason
    # An app that refuses the upgrade: its 4xx reaches the caller, nothing else.
    assert await refused(f"{world.ws}/v1/agents/ws/users/ada/app/ws/refuse", {"Authorization": f"Bearer {world.acme}"}) == 403
    # At most app_ws_max_sockets at once per instance; a closed one frees its place.
    held = [await owner(world, "ada").__aenter__() for _ in range(MAX_SOCKETS)]
    try:
        assert await refused(f"{world.ws}/v1/agents/ws/users/ada/app/ws", {"Authorization": f"Bearer {world.acme}"}) == 429
        for ws in held:
            await ws.send("alive")
            assert await ws.recv() == "alive"
    finally:
        for ws in held:
            await ws.close()
    for _ in range(100):  # the host releases a place once the close has been relayed
        try:
            async with owner(world, "ada") as ws:
                await ws.send("again")
                assert await ws.recv() == "again"
            break
        except InvalidStatus:
            await asyncio.sleep(0.1)
    else:
        pytest.fail("closed sockets never freed their places")


#: A caller in a process of its own (so that its buffers are not counted as the host's): it asks for a flood,
#: reads nothing until told to on stdin, then checks every message.
SLOW_CALLER = r'''
import asyncio, sys
from websockets.asyncio.client import connect

async def main(url, key, n, size):
    async with connect(url, additional_headers={"Authorization": "Bearer " + key}, max_queue=4, open_timeout=120) as ws:
        await ws.send("flood %d %d" % (n, size))
        print("flooding", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        for i in range(n):
            m = await asyncio.wait_for(ws.recv(), 120)
            assert int.from_bytes(m[:4], "big") == i and len(m) == size, (i, len(m))
        print("all %d in order" % n, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
'''


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_a_caller_that_does_not_read_costs_the_host_no_memory(world: World) -> None:
    # 48 MiB the app wants to send to a caller that reads nothing for a while: the host pulls the app's bytes only
    # as the caller takes messages, so its memory stays flat (the rest waits in socket buffers and in the app).
    size, n = MAX_MESSAGE - 1024, 768
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SLOW_CALLER, f"{world.ws}/v1/agents/ws/users/ada/app/ws", world.acme, str(n), str(size),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 120) == b"flooding\n"
        base = peak = _rss()
        for _ in range(50):
            await asyncio.sleep(0.1)
            peak = max(peak, _rss())
        assert peak - base < 16 << 20, f"host memory grew by {(peak - base) >> 20} MiB while the caller read nothing"
        proc.stdin.write(b"read\n")
        await proc.stdin.drain()
        assert await asyncio.wait_for(proc.stdout.readline(), 300) == f"all {n} in order\n".encode()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
