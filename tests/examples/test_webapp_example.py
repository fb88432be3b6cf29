"""Example 4 (examples/webapp) end to end in micro-VMs: its requirements.txt installed at deploy time from a
package index (a loopback PEP 503 index serving a wheel of the tabulate this venv has), an allowed API called
with a secret the host adds (the sandbox never holds it), and a page of its results on its port, served by the
host, after a sleep too."""

from __future__ import annotations

import functools
import http.server
import importlib.metadata
import json
import threading
import uuid
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from moorage.config import Config
from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.runtime.app_proxy import AppRequest, app_request
from moorage.runtime.host_calls import secrets_of
from moorage.store import EntityKey, Scope
from tests.egress.test_vm_network import _env
from tests.runtime.conftest import Env

pytestmark = pytest.mark.asyncio(loop_scope="module")

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


def _wheel_of_installed(name: str, out_dir: Path) -> Path:
    """A wheel of a pure-Python distribution installed in this venv (no network, no build)."""
    dist = importlib.metadata.distribution(name)
    wheel = out_dir / f"{name}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in dist.files or ():
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith("INSTALLER"):
                continue
            z.write(f.locate(), rel)
    return wheel


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1/quote"
    srv.shutdown()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("index")
    wheel = _wheel_of_installed("tabulate", root)
    (root / "simple" / "tabulate").mkdir(parents=True)
    (root / "simple" / "tabulate" / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')

    class Index(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Index, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory, index: int) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("webapp")
    cfg = Config(data_dir=tmp / "data", sandbox_driver="microvm", egress_allow_cidrs="127.0.0.0/8",
                 egress_package_index=f"http://pypi.test:{index}", package_index_url=f"http://pypi.test:{index}/simple/")
    async for e in _env(tmp, cfg):
        e.runtime.egress = e.runtime.templates.egress = Egress(OperatorPolicy.from_config(cfg),
                                                               StaticResolver({"pypi.test": ["127.0.0.1"]}))
        yield e


async def _page(env: Env, path: str = "/") -> tuple[int, bytes]:
    async def nobody():  # type: ignore[no-untyped-def]
        return
        yield b""

    ts = env.store.tenant(env.principal)
    resp = await app_request(env.runtime, ts, "digest", "ada",
                             AppRequest("GET", path.encode(), [], nobody(), "/v1/agents/digest/users/ada/app"))
    return resp.status, b"".join([c async for c in resp.body])


async def test_webapp_example_tracks_an_api_with_a_hidden_secret_and_serves_a_page(env: Env, api: str) -> None:
    progress: list[str] = []
    await env.runtime.deploy(env.principal, EXAMPLE, on_progress=progress.append)
    assert any("installing requirements.txt" in p for p in progress), progress
    ts = env.store.tenant(env.principal)
    secrets_of(env.runtime).set(ts, "digest", "API_TOKEN", SECRET)
    k = EntityKey("digest", "ada")
    r = await env.runtime.invoke(env.principal, k, f"track {api}")
    assert r.reply == 'tracked {"price": 42}'
    assert _Api.auth == [f"Bearer {SECRET}"]  # added by the host on the way out
    status, page = await _page(env)
    # The table is tabulate's (installed at deploy time), its cells escaped.
    assert status == 200 and b"<h1>Tracked values</h1>" in page and b"<td>{&quot;price&quot;: 42}" in page
    assert b"<thead>" in page and SECRET.encode() not in page
    # The sandbox never held the secret: not in its environment, files or the results it keeps.
    sandbox = await env.runtime.driver.open(ts.sandboxes.for_scope(Scope.for_user("digest", "ada")).id)
    seen = await sandbox.exec(["sh", "-c", "env; cat /proc/*/environ 2>/dev/null; grep -rs tok_ /work /tmp; true"])
    assert SECRET.encode() not in seen.stdout + seen.stderr
    # Asleep and woken by the page's next request: the results are on the sandbox's disk.
    assert await env.manager.sleep(ts, Scope.for_user("digest", "ada"))
    status, data = await _page(env, "/results.json")
    assert status == 200 and [x["value"] for x in json.loads(data)] == [{"price": 42}]
    assert (await env.runtime.invoke(env.principal, k, "list")).reply == "1 values tracked"
