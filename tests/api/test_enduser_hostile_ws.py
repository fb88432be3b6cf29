"""A WebSocket to an agent's app outlived the credential that opened it: an end-user token that expired, a key
revoked (and the end-user tokens it issued with it), a share link revoked all refused the next handshake, but a
socket already open stayed open for good. Now each is closed (1008) within a recheck of the credential."""

from __future__ import annotations

import asyncio
import io
import tarfile
import textwrap
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moorage.api import credential_watch
from tests.api.conftest import aclient
from tests.app.wsapp import agent_py

ECHO_APP = agent_py(r'''
class Handler(AppHandler):
    def respond(self):
        if not self.upgrade():
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            return
        self.switch()
        while True:
            opcode, data = self.read_frame()
            if opcode is None or opcode == 8:
                if opcode == 8:
                    self.frame(8, data[:2])
                return
            if opcode == 9:
                self.frame(10, data)
            else:
                self.frame(opcode, data)


serve(Handler)


async def on_message(ctx, message):
    return "ok"
''')


def _archive(tmp: Path) -> bytes:
    root = tmp / "wsecho"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "wsecho"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(ECHO_APP))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


async def _closed_within(ws: ClientConnection, seconds: float) -> tuple[int, str]:
    """The close the server sends within ``seconds`` (the socket still answering meanwhile fails the test)."""
    with pytest.raises(ConnectionClosed) as e:
        async with asyncio.timeout(seconds):
            while True:
                await ws.recv()
    assert e.value.rcvd is not None
    return e.value.rcvd.code, e.value.rcvd.reason


async def test_open_sockets_end_with_their_credential(live_rt, acme: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(credential_watch, "RECHECK_S", 0.2)
    ws_url = live_rt.url.replace("http://", "ws://")
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/wsecho/deployments", content=_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/wsecho/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        # A backend's key that issues the browser's tokens, and two of its tokens: a short one and a long one.
        issuer = (await c.post("/v1/keys", json={"scopes": ["deploy"]})).json()
        async with aclient(live_rt, issuer["secret"]) as b:
            short = (await b.post("/v1/agents/wsecho/users/ada/tokens", json={"ttl_s": 4})).json()["token"]
            long = (await b.post("/v1/agents/wsecho/users/ada/tokens", json={"ttl_s": 3600})).json()["token"]
        link = (await c.post("/v1/agents/wsecho/users/ada/share-links", json={"ttl_s": 3600})).json()

        app = f"{ws_url}/v1/agents/wsecho/users/ada/app/ws"
        async with connect(app, additional_headers={"Authorization": f"Bearer {short}"}, open_timeout=60) as ws:
            await ws.send("hello")
            assert await ws.recv() == "hello"
            # The token expires while the socket is open.
            code, reason = await _closed_within(ws, 8)
        assert code == 1008 and "revoked or expired" in reason

        async with connect(app, additional_headers={"Authorization": f"Bearer {long}"}, open_timeout=60) as user_ws, \
                connect(f"{ws_url}{link['url']}ws", open_timeout=60) as link_ws:
            for ws in (user_ws, link_ws):
                await ws.send("x")
                assert await ws.recv() == "x"
            await asyncio.sleep(0.5)  # checked again and still good: left open
            await user_ws.send("still")
            assert await user_ws.recv() == "still"
            # The leaked key is revoked: its end-user tokens die with it, open sockets included.
            assert (await c.delete(f"/v1/keys/{issuer['id']}")).status_code in (200, 204)
            assert await _closed_within(user_ws, 5) == (1008, "the credential that opened this socket was revoked "
                                                              "or expired")
            await link_ws.send("y")
            assert await link_ws.recv() == "y"  # the link is another credential, still live
            assert (await c.delete(f"/v1/agents/wsecho/users/ada/share-links/{link['id']}")).status_code == 200
            code, reason = await _closed_within(link_ws, 5)
        assert code == 1008 and reason == "the share link that opened this socket was revoked or expired"
        # The instance and its app serve on: a socket with a live credential opens and works.
        async with connect(app, additional_headers={"Authorization": f"Bearer {acme}"}, open_timeout=60) as ws:
            await ws.send("after")
            assert await ws.recv() == "after"


async def test_the_app_is_refused_past_the_compute_cap(live_rt, store, acme: str, tmp_path: Path) -> None:
    """The app's routes woke the instance without a look at the user's caps: past compute_seconds_per_day a user (or
    anyone with their share link) could wake it again and again. Now a 429 cap-exceeded, as for a turn."""
    import time

    from moorage.store import Scope
    from moorage.usage import caps

    ts = store.tenant(store.authenticate(acme))
    ws_url = live_rt.url.replace("http://", "ws://")
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/wsecho/deployments", content=_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.put("/v1/agents/wsecho/users/ada", json={"limits": {"compute_seconds_per_day": 1}})).status_code == 201
        token = (await c.post("/v1/agents/wsecho/users/ada/tokens", json={"ttl_s": 600})).json()["token"]
        link = (await c.post("/v1/agents/wsecho/users/ada/share-links", json={"ttl_s": 600})).json()
        async with aclient(live_rt, token) as u:
            assert (await u.get("/v1/agents/wsecho/users/ada/app/")).status_code == 200  # wakes it: under the cap
            while caps.compute_seconds(ts, "wsecho", "ada", since=caps.day_window(time.time())[0]) < 1:
                await asyncio.sleep(0.05)
            r = await u.get("/v1/agents/wsecho/users/ada/app/")
            assert r.status_code == 429 and r.json()["type"].endswith("/cap-exceeded"), r.text
            assert "compute_seconds_per_day" in r.json()["detail"] and int(r.headers["retry-after"]) >= 1
            assert ts.sandboxes.for_scope(Scope.for_user("wsecho", "ada")).state == "sleeping"
            r = await u.get(link["url"])
            assert r.status_code == 429, r.text
            assert ts.sandboxes.for_scope(Scope.for_user("wsecho", "ada")).state == "sleeping"  # not woken again
        with pytest.raises(InvalidStatus) as e:
            async with connect(f"{ws_url}{link['url']}ws", open_timeout=60):
                pass
        assert e.value.response.status_code == 429
        assert ts.sandboxes.for_scope(Scope.for_user("wsecho", "ada")).state == "sleeping"
        # Raised: served again.
        assert (await c.put("/v1/agents/wsecho/users/ada", json={"limits": {"compute_seconds_per_day": 3600}})).status_code == 200
        async with aclient(live_rt, token) as u:
            assert (await u.get("/v1/agents/wsecho/users/ada/app/")).status_code == 200
