"""Holes found by a hostile pass over the end-user surface: tokens, their filters and limits, through the real HTTP
server and runtime."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from moorage.client import AuthError
from moorage import AsyncClient
from moorage.api import create_app
from moorage.config import Config
from moorage.devservices.fleet import LocalHost
from moorage.store import Store
from tests.api.conftest import aclient, agent_archive, serve
from tests.api.test_users import existing_users_archive

GZ = {"content-type": "application/gzip"}


async def test_a_token_for_a_user_an_existing_users_agent_lacks_is_refused(live_rt, acme: str,
                                                                            tmp_path: Path) -> None:
    """On a `users = "existing"` agent a token issued before the product's PUT was tied to no record: once the user
    was made and then forgotten (and made again for another person), the old token still acted for them. It is now
    a 404 that says to create the user first; a token issued after the PUT dies with the user as before."""
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/strict/deployments", content=existing_users_archive(tmp_path),
                             headers=GZ)).status_code == 201
        r = await c.post("/v1/agents/strict/users/gil/tokens", json={"ttl_s": 600})
        assert r.status_code == 404, r.text
        problem = r.json()
        assert problem["detail"] == "agent 'strict' has no user 'gil'"
        assert "PUT /v1/agents/strict/users/gil" in problem["hint"] and "then issue the token" in problem["hint"]

        assert (await c.put("/v1/agents/strict/users/gil", json={})).status_code == 201
        r = await c.post("/v1/agents/strict/users/gil/tokens", json={"ttl_s": 600})
        assert r.status_code == 201, r.text
        token = r.json()["token"]
    async with AsyncClient(live_rt.url, token) as browser:
        assert (await browser.whoami())["user"] == "gil"
    async with aclient(live_rt, acme) as c:
        assert (await c.delete("/v1/agents/strict/users/gil")).status_code == 200
        assert (await c.put("/v1/agents/strict/users/gil", json={})).status_code == 201  # another person, same id
    async with AsyncClient(live_rt.url, token) as browser:
        with pytest.raises(AuthError) as refused:
            await browser.whoami()
        assert refused.value.status == 401 and "since been forgotten" in refused.value.detail


def test_a_client_that_stops_reading_its_answers_is_dropped(tmp_path: Path) -> None:
    """A client that sent requests (here pipelined, many at once) and then read nothing held its connection for
    good, with an answer's bytes in the host's memory (and, for a stream, the stream and its end-user's place). Now
    the connection is dropped once the client took nothing for ``http_write_stall_s``; others are served meanwhile."""
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_HTTP_WRITE_STALL_S": "1"},
                     start_timeout_s=120)
    try:
        size = len(httpx.get(f"{host.url}/openapi.json", timeout=30).content)
        n = max(4, (32 << 20) // size)  # more answers than the sockets' buffers hold
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", host.port))
            s.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: h\r\n\r\n" * n)
            time.sleep(4)  # reads nothing meanwhile
            assert httpx.get(f"{host.url}/healthz", timeout=5).status_code == 200
            got = 0
            s.settimeout(10)
            try:
                while chunk := s.recv(1 << 16):
                    got += len(chunk)
            except (ConnectionResetError, socket.timeout):
                pass
        assert got < n * size, f"all {n} answers were sent to a reader that stalled for 4 s"
    finally:
        host.stop()


def test_cors_origins_match_as_browsers_send_them_and_every_answer_varies_by_origin(tmp_path: Path,
                                                                                    store: Store) -> None:
    """An origin named with capitals or its default port (https://App.example.com:443) matched no page, since a
    browser sends it in lower case without the port: the page was refused with nothing said. And an answer without
    CORS headers (no Origin, another origin) did not say ``Vary: Origin``, so a cache in between could hand it to the
    named page, which then could not read it. Neither any longer; credentials are still never allowed."""
    key = store.operator.create_tenant("acme")[1].secret
    app = create_app(store, Config(data_dir=tmp_path / "data", cors_origins="https://App.Example.com:443"))
    srv, thread, url = serve(app)
    try:
        page = "https://app.example.com"
        pre = httpx.options(url + "/v1/whoami", timeout=30, headers={
            "Origin": page, "Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page, pre.headers
        assert "access-control-allow-credentials" not in pre.headers
        for origin in (page, "https://evil.example", "null", None):
            r = httpx.get(url + "/v1/whoami", timeout=30, headers={"Authorization": f"Bearer {key}",
                                                                 **({"Origin": origin} if origin else {})})
            assert r.status_code == 200
            assert "origin" in r.headers.get("vary", "").lower(), (origin, r.headers)
            assert r.headers.get("access-control-allow-origin") == (page if origin == page else None), origin
            assert "access-control-allow-credentials" not in r.headers
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


async def test_an_end_user_token_reads_no_one_elses_runs_or_usage_through_filters(live_rt, acme: str,
                                                                                 tmp_path: Path) -> None:
    """The tenant-wide listings that take ``?agent=&user=`` (workflow runs, usage and its caps) are not end-user
    routes: a token is refused (403) whichever user it names, its own included, and says nothing of the other's."""
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.put("/v1/agents/echo/users/bob", json={"limits": {"tokens_per_month": 987654}})).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "secret-of-bob", "user": "bob"})).status_code == 200
        token = (await c.post("/v1/agents/echo/users/ada/tokens", json={"ttl_s": 600})).json()["token"]
    async with aclient(live_rt, token) as ada:
        for path in ("/v1/workflows?agent=echo&user=bob", "/v1/workflows?agent=echo&user=ada", "/v1/workflows",
                     "/v1/usage?agent=echo&user=bob", "/v1/usage?agent=echo&user=ada", "/v1/usage?user=bob",
                     "/v1/usage", "/v1/traces?agent=echo"):
            r = await ada.get(path)
            assert r.status_code == 403, (path, r.text)
            assert "bob" not in r.text and "987654" not in r.text, (path, r.text)


def test_a_request_body_that_stops_halfway_closes_its_connection(tmp_path: Path) -> None:
    """A request with a credential whose body stopped halfway held its connection and its handler for good (the
    header deadline times only headers). Now the body must keep coming: a pause of ``http_header_timeout_s`` closes
    the connection; a body that keeps coming slowly is still answered."""
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_HTTP_HEADER_TIMEOUT_S": "1"},
                     start_timeout_s=120)
    try:
        head = (b"POST /v1/keys HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {host.key}\r\nContent-Length: 1000\r\n\r\n".encode())
        stopped = [socket.create_connection(("127.0.0.1", host.port)) for _ in range(5)]
        for s in stopped:
            s.sendall(head + b'{"scopes": ["read"], "label": "')
        started = time.monotonic()
        for s in stopped:
            s.settimeout(max(0.1, started + 5 - time.monotonic()))
            try:
                assert s.recv(4096) == b"", "answered without its body"
            except ConnectionResetError:
                pass
            except socket.timeout:
                raise AssertionError("a connection whose body stopped is still open after 5 s") from None
            finally:
                s.close()
        body = b'{"scopes": ["read"]}'
        with socket.create_connection(("127.0.0.1", host.port)) as ok:
            ok.sendall(head.replace(b"Content-Length: 1000", f"Content-Length: {len(body)}".encode()))
            for i in range(0, len(body), 4):  # slowly, but never a pause of the timeout
                ok.sendall(body[i:i + 4])
                time.sleep(0.4)
            ok.settimeout(10)
            assert ok.recv(4096).startswith(b"HTTP/1.1 201")
    finally:
        host.stop()
