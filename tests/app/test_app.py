"""An agent's own web app in its micro-VM, served by the host over the channel, with the owner's key and through
share links: per-user content, a sleeping instance woken by the first request, bounded bodies, headers that
stay on the host's side, links that stop at expiry and at revocation, and nothing across tenants or users."""

from __future__ import annotations

import asyncio
import hashlib
import json
import io
import tarfile
import textwrap
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import pytest_asyncio
import uvicorn

from moorage.api import create_app
from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.store import Scope, open_store
from tests.api.conftest import free_port
from tests.conftest import stop_all_sandboxes

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The app is a thread the agent module starts when it is loaded (in the template, so every fork has it running).
WEB_AGENT = '''
import hashlib, http.server, json, threading

NOTE = "/work/note.txt"


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body, ctype="text/plain"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Set-Cookie", "session=app-cookie; Path=/")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/hangup"):
            self.close_connection = True  # no answer at all
            return
        if self.path.startswith("/big"):
            n = 3 << 20
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            for _ in range(n >> 16):
                self.wfile.write(b"x" * 65536)
        elif self.path.startswith("/echo"):
            seen = {"path": self.path, "auth": self.headers.get("Authorization"),
                    "cookie": self.headers.get("Cookie"), "prefix": self.headers.get("X-Forwarded-Prefix"),
                    "custom": self.headers.get("X-Custom")}
            self._send(200, json.dumps(seen).encode(), "application/json")
        else:
            try:
                note = open(NOTE).read()
            except OSError:
                note = "(none)"
            self._send(200, ("<p>note: %s</p>" % note).encode(), "text/html")

    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(201, json.dumps({"len": len(data), "sha256": hashlib.sha256(data).hexdigest()}).encode(),
                   "application/json")

    def log_message(self, *args):
        pass


def _serve():
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler).serve_forever()
    except OSError:
        pass  # loaded again in the same guest: the first server keeps serving


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    with open(NOTE, "w") as f:
        f.write(message)
    return "noted"
'''


def _archive(tmp: Path) -> bytes:
    root = tmp / "web"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(WEB_AGENT))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


class World:
    url: str
    runtime: Runtime
    acme: str
    globex: str
    store: Any


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    from tests.sandbox.conftest import DRIVER_FACTORIES

    tmp = tmp_path_factory.mktemp("app")
    cfg = Config(data_dir=tmp / "data", sandbox_driver="microvm", app_max_response_bytes=2 << 20)
    store = open_store(cfg)
    acme = store.operator.create_tenant("acme")[1].secret
    globex = store.operator.create_tenant("globex")[1].secret
    driver = DRIVER_FACTORIES["microvm"](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    app = create_app(rt, cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    w = World()
    w.url, w.runtime, w.acme, w.globex, w.store = f"http://127.0.0.1:{port}", rt, acme, globex, store
    async with httpx.AsyncClient(base_url=w.url, headers={"Authorization": f"Bearer {acme}"}, timeout=300) as c:
        r = await c.post("/v1/agents/web/deployments", content=_archive(tmp), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        for user, note in (("ada", "ada-only"), ("bob", "bob-only")):
            r = await c.post("/v1/agents/web/invoke", json={"message": note, "user": user})
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


def client(w: World, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=w.url, headers=headers, timeout=120)


async def test_owner_reaches_each_users_app_and_other_tenants_do_not(world: World) -> None:
    async with client(world, world.acme) as c:
        for user in ("ada", "bob"):
            r = await c.get(f"/v1/agents/web/users/{user}/app/")
            assert r.status_code == 200, r.text
            assert r.text == f"<p>note: {user}-only</p>"
            assert r.headers["content-type"] == "text/html"
            # Served on the API's origin, the page gets a sandboxed origin and cannot set the API's cookies.
            assert r.headers["content-security-policy"].startswith("sandbox")
            assert r.headers["referrer-policy"] == "no-referrer"
            assert "set-cookie" not in r.headers
            # One Server and one Date, the host's (the app's own are not relayed beside them).
            assert len(r.headers.get_list("server")) == 1 and len(r.headers.get_list("date")) == 1
        r = await c.get("/v1/agents/web/users/ada/app", follow_redirects=False)
        assert r.status_code == 308 and r.headers["location"] == "/v1/agents/web/users/ada/app/"
        # The app sees its own path and query, never the caller's key or cookies.
        r = await c.get("/v1/agents/web/users/ada/app/echo/a%20b?q=1&r=2", headers={"X-Custom": "kept", "Cookie": "k=v"})
        seen = r.json()
        assert seen == {"path": "/echo/a%20b?q=1&r=2", "auth": None, "cookie": None,
                        "prefix": "/v1/agents/web/users/ada/app", "custom": "kept"}
        body = bytes(range(256)) * 4096  # 1 MiB, relayed in several frames
        r = await c.post("/v1/agents/web/users/ada/app/upload", content=body)
        assert r.status_code == 201 and r.json() == {"len": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        # Bounded: an answer declared over app_max_response_bytes (2 MiB here) is refused, not relayed.
        r = await c.get("/v1/agents/web/users/ada/app/big")
        assert r.status_code == 413 and r.json()["type"].endswith("app-too-large")
        # An app that hangs up without answering: a 502 that says so, not a generic server failure.
        r = await c.get("/v1/agents/web/users/ada/app/hangup")
        assert r.status_code == 502 and r.json()["type"].endswith("app-unavailable"), r.text
        assert "app" in r.json()["detail"] and "report trace id" not in (r.json()["hint"] or ""), r.text
    async with client(world, world.globex) as other:
        for path in ("/v1/agents/web/users/ada/app/", "/v1/agents/web/users/ada/app",
                     "/v1/agents/web/users/ada/share-links"):
            r = await other.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert "ada-only" not in r.text
        r = await other.post("/v1/agents/web/users/ada/share-links", json={"ttl_s": 60})
        assert r.status_code == 404
    async with client(world) as anonymous:
        assert (await anonymous.get("/v1/agents/web/users/ada/app/")).status_code == 401


async def test_end_user_token_opens_only_its_own_app(world: World) -> None:
    async with client(world, world.acme) as c:
        token = (await c.post("/v1/agents/web/users/ada/tokens", json={})).json()["token"]
    async with client(world, token) as ada:
        assert (await ada.get("/v1/agents/web/users/ada/app/")).text == "<p>note: ada-only</p>"
        r = await ada.get("/v1/agents/web/users/bob/app/")
        assert r.status_code == 403 and "bob-only" not in r.text


async def test_share_links_open_one_app_until_expiry_or_revocation(world: World) -> None:
    async with client(world, world.acme) as c:
        r = await c.post("/v1/agents/web/users/ada/share-links", json={"ttl_s": 3600, "label": "for review"})
        assert r.status_code == 201, r.text
        ada_link = r.json()
        bob_link = (await c.post("/v1/agents/web/users/bob/share-links", json={"ttl_s": 3600})).json()
        short = (await c.post("/v1/agents/web/users/ada/share-links", json={"ttl_s": 1})).json()
        listed = (await c.get("/v1/agents/web/users/ada/share-links")).json()["data"]
        assert {x["id"] for x in listed} == {ada_link["id"], short["id"]}
        assert all("token" not in x for x in listed)
    async with client(world) as anyone:
        r = await anyone.get(ada_link["url"])
        assert r.status_code == 200 and r.text == "<p>note: ada-only</p>"
        r = await anyone.get(ada_link["url"] + "echo?x=1")
        assert r.json()["path"] == "/echo?x=1" and r.json()["prefix"] == ada_link["url"].rstrip("/")
        assert (await anyone.get(bob_link["url"])).text == "<p>note: bob-only</p>"
        r = await anyone.get(ada_link["url"].rstrip("/"), follow_redirects=False)
        assert r.status_code == 308
        # A link reaches its app and nothing else: not the API (no key), not another user's app.
        assert (await anyone.get("/v1/agents/web/users/ada/app/", headers={"Authorization": f"Bearer {ada_link['token']}"})).status_code == 401
        # Altered tokens: another link's id under this link's signature, another tenant, a longer life.
        tenant, link_id, expires, kid, mac = ada_link["token"].split(".")
        bob_id = bob_link["token"].split(".")[1]
        globex_tenant = world.store.authenticate(world.globex).tenant_id
        for forged in (f"{tenant}.{bob_id}.{expires}.{kid}.{mac}", f"{globex_tenant}.{link_id}.{expires}.{kid}.{mac}",
                       f"{tenant}.{link_id}.{int(expires) + 10**6}.{kid}.{mac}", f"{tenant}.{link_id}.{expires}.{kid}.{mac[:-2]}AA",
                       "nonsense", ada_link["token"] + "x"):
            r = await anyone.get(f"/v1/shared/{forged}/")
            assert r.status_code == 404, (forged, r.status_code)
            assert "ada-only" not in r.text and "bob-only" not in r.text
        # Expiry.
        await asyncio.sleep(1.2)
        assert (await anyone.get(short["url"])).status_code == 404
        # Revocation: the link stops at once; the other links keep working.
        async with client(world, world.acme) as c:
            r = await c.delete(f"/v1/agents/web/users/ada/share-links/{ada_link['id']}")
            assert r.status_code == 200 and r.json()["revoked_at"] is not None
            # Another user's link is not revocable under this user (and is untouched).
            assert (await c.delete(f"/v1/agents/web/users/ada/share-links/{bob_link['id']}")).status_code == 404
        async with client(world, world.globex) as other:
            assert (await other.delete(f"/v1/agents/web/users/bob/share-links/{bob_link['id']}")).status_code == 404
        assert (await anyone.get(ada_link["url"])).status_code == 404
        assert (await anyone.get(bob_link["url"])).status_code == 200


async def test_first_request_wakes_a_sleeping_instance(world: World) -> None:
    rt = world.runtime
    principal = world.store.authenticate(world.acme)
    ts = world.store.tenant(principal)
    scope = Scope.for_user("web", "bob")
    assert await rt.instances.sleep(ts, scope)
    assert ts.sandboxes.for_scope(scope).state == "sleeping"
    async with client(world, world.acme) as c:
        link = (await c.post("/v1/agents/web/users/bob/share-links", json={"ttl_s": 600})).json()
    async with client(world) as anyone:
        r = await anyone.get(link["url"])
    assert r.status_code == 200 and r.text == "<p>note: bob-only</p>"
    assert ts.sandboxes.for_scope(scope).state == "running"


async def test_moorage_share_cli_makes_lists_and_revokes_links(world: World, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moorage.cli.main import app

    env = {"MOORAGE_API_URL": world.url, "MOORAGE_API_KEY": world.acme, "MOORAGE_DATA_DIR": str(tmp_path)}

    def cli(*args: str) -> str:
        from moorage import log

        try:
            r = CliRunner().invoke(app, list(args), env=env)
        finally:
            log.configure("warning", "text")  # the CLI pointed logging at the runner's stream, closed by now
        assert r.exit_code == 0, r.output
        return r.stdout.strip()  # server-side log lines of this process go to stderr

    # The CLI's client is synchronous; the server runs on this loop, so the CLI runs in a thread.
    url = await asyncio.to_thread(cli, "share", "web", "ada", "--ttl", "10m", "--label", "cli")
    assert url.startswith(world.url + "/v1/shared/")
    async with client(world) as anyone:
        assert (await anyone.get(url)).text == "<p>note: ada-only</p>"
        listed = json.loads(await asyncio.to_thread(cli, "share", "web", "ada", "--list", "--json"))["data"]
        mine = [x for x in listed if x["label"] == "cli"]
        assert len(mine) == 1 and round(mine[0]["expires_at"] - mine[0]["created_at"]) == 600
        assert "revoked" in await asyncio.to_thread(cli, "share", "web", "ada", "--revoke", mine[0]["id"])
        assert (await anyone.get(url)).status_code == 404
