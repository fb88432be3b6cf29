"""Example 4 (examples/webapp) end to end: the agent calls an allowed API with a secret the host adds (the
sandbox never holds it) and serves a page of its results on its port, through the host, across a sleep."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from moorage.runtime.app_proxy import AppRequest, app_request
from moorage.runtime.host_calls import secrets_of
from moorage.store import EntityKey, Scope

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "webapp"
SECRET = f"tok_{uuid.uuid4().hex}"


class _Api(BaseHTTPRequestHandler):
    auth: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        _Api.auth.append(self.headers.get("Authorization", ""))
        ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
        data = json.dumps({"price": 42} if ok else {"error": "no token"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    _Api.auth = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1/quote"
    srv.shutdown()


async def _page(env, path: str = "/") -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    async def nobody():  # type: ignore[no-untyped-def]
        return
        yield b""

    ts = env.store.tenant(env.principal)
    resp = await app_request(env.runtime, ts, "digest", "ada",
                             AppRequest("GET", path.encode(), [], nobody(), "/v1/agents/digest/users/ada/app"))
    return resp.status, b"".join([c async for c in resp.body])


async def test_webapp_example_tracks_an_api_with_a_hidden_secret_and_serves_a_page(env, api: str) -> None:
    await env.runtime.deploy(env.principal, EXAMPLE)
    ts = env.store.tenant(env.principal)
    secrets_of(env.runtime).set(ts, "digest", "API_TOKEN", SECRET)
    k = EntityKey("digest", "ada")
    r = await env.runtime.invoke(env.principal, k, f"track {api}")
    assert r.reply == 'tracked {"price": 42}'
    assert _Api.auth == [f"Bearer {SECRET}"]  # added by the host on the way out
    status, page = await _page(env)
    assert status == 200 and b"<h1>Tracked values</h1>" in page and b"{&quot;price&quot;: 42}" in page
    assert SECRET.encode() not in page
    # The sandbox never held the secret: not in its environment, files or the results it keeps.
    sandbox = await env.runtime.driver.open(ts.sandboxes.for_scope(Scope.for_user("digest", "ada")).id)
    seen = await sandbox.exec(["sh", "-c", "env; cat /proc/*/environ 2>/dev/null; grep -rs tok_ /work /tmp; true"])
    assert SECRET.encode() not in seen.stdout + seen.stderr
    # Asleep and woken by the page's next request: the results are on the sandbox's disk.
    assert await env.manager.sleep(ts, Scope.for_user("digest", "ada"))
    status, data = await _page(env, "/results.json")
    assert status == 200 and [x["value"] for x in json.loads(data)] == [{"price": 42}]
    # The page is there after the wake, and the agent keeps tracking.
    assert (await env.runtime.invoke(env.principal, k, "list")).reply == "1 values tracked"
