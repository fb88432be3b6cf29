"""Slow clients against a real ``moorage up``: a connection that sends its request headers a byte at a time, nothing
at all, or a body that trickles on after the answer (a request refused unread) was held by the server for good (uvicorn times out only an idle kept-alive connection), so anyone,
without any credential, could hold every file descriptor of the host with a few thousand sockets."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
from websockets.asyncio.client import connect

from moorage.devservices.fleet import LocalHost
from tests.api.test_enduser_hostile_ws import _archive

TIMEOUT_S = 1.0


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``within_s``; False when it stays open."""
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_slow_and_silent_connections_are_closed_and_others_still_served(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning",
                                               "MOORAGE_HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S)}, start_timeout_s=120)
    socks: list[socket.socket] = []
    try:
        address = ("127.0.0.1", host.port)
        silent = [socket.create_connection(address) for _ in range(20)]
        slow = [socket.create_connection(address) for _ in range(20)]
        socks += silent + slow
        # A kept-alive connection: one request answered, then the next one's headers begun and never finished.
        kept = socket.create_connection(address)
        socks.append(kept)
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /healthz HTTP/1.1\r\n")
        # No credential, a large body announced: answered 401 unread, then the body trickles on after the answer.
        unread = socket.create_connection(address)
        socks.append(unread)
        unread.sendall(b"POST /v1/agents/echo/invoke HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000000\r\n\r\n{")
        unread.settimeout(10)
        assert unread.recv(4096).startswith(b"HTTP/1.1 401")
        started = time.monotonic()
        # The slow ones trickle a header line every 0.2 s: never complete, always sending.
        for i in range(int(3 * TIMEOUT_S / 0.2)):
            for s in [*slow, unread]:
                try:
                    s.sendall(b"a" if s is unread else b"GET / HTTP/1.1\r\n" if i == 0 else f"X-{i}: a\r\n".encode())
                except OSError:
                    pass  # closed by the server already
            time.sleep(0.2)
        # Meanwhile an ordinary client is served.
        assert httpx.get(f"{host.url}/healthz", timeout=5).status_code == 200
        closed = [_closed_by_server(s, 2.0) for s in socks]
        assert all(closed), f"{closed.count(False)} of {len(closed)} slow connections still open after " \
                            f"{time.monotonic() - started:.1f} s"
        # A request whose headers come in time is served as before, its body (here sent slowly) not timed by this.
        body = b'{"scopes": ["read"]}'
        with socket.create_connection(address) as ok:
            ok.sendall(b"POST /v1/keys HTTP/1.1\r\nHost: h\r\nConnection: close\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {host.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            for i in range(0, len(body), 4):
                ok.sendall(body[i:i + 4])
                time.sleep(2 * TIMEOUT_S / 5)
            ok.settimeout(10)
            assert ok.recv(4096).startswith(b"HTTP/1.1 201")
        # A WebSocket (its handshake's headers came in time) is not cut by the deadline however long it stays open.
        with httpx.Client(base_url=host.url, headers={"Authorization": f"Bearer {host.key}"}, timeout=300) as c:
            r = c.post("/v1/agents/wsecho/deployments", content=_archive(tmp_path),
                       headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
        asyncio.run(_socket_outlives_the_deadline(f"ws://127.0.0.1:{host.port}", host.key))
    finally:
        for s in socks:
            s.close()
        host.stop()


async def _socket_outlives_the_deadline(ws_url: str, key: str) -> None:
    app = f"{ws_url}/v1/agents/wsecho/users/ada/app/ws"
    async with connect(app, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=120) as ws:
        for i in range(4):
            await ws.send(f"m{i}")
            assert await ws.recv() == f"m{i}"
            await asyncio.sleep(TIMEOUT_S)
