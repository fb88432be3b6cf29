"""API test fixtures: a real uvicorn server on 127.0.0.1 (free port) over the real store, and clients.

The server runs in a thread of the test process, so tests can also look at the store directly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import uvicorn

from moorage.api import create_app
from moorage.cli.up import bound_port
from moorage.config import Config
from moorage.store import Store
from tests.conftest import stop_all_sandboxes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: Any
    data_dir: Path

    @property
    def operator_token(self) -> str:
        return (self.data_dir / "api" / "operator-token").read_text().strip()

    def client(self, secret: str | None = None, **headers: str) -> httpx.Client:
        h = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, headers={**h, **headers}, timeout=60)


def serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` served on a port the kernel picks (one chosen here first could be taken by another worker's server
    before this one listened)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{bound_port(server, 0)}"


@pytest.fixture
def live(tmp_path: Path, store: Store) -> Iterator[LiveServer]:
    yield from start_live(store, tmp_path)


def start_live(runtime_or_store: Any, tmp_path: Path) -> Iterator[LiveServer]:
    config = Config(data_dir=tmp_path / "data")
    app = create_app(runtime_or_store, config)
    server, thread, url = serve(app)
    try:
        yield LiveServer(url, app, config.data_dir)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def acme(store: Store) -> str:
    """The admin key secret of a fresh tenant."""
    return store.operator.create_tenant("acme")[1].secret


@pytest.fixture
def globex(store: Store) -> str:
    return store.operator.create_tenant("globex")[1].secret


# -- a real runtime: process sandboxes, the instance manager, the store of the `store` fixture ------------

AGENT = '''
async def on_message(ctx, message):
    if message.startswith("stream "):
        for word in message[len("stream "):].split():
            await ctx.emit("token", word + " ")
        return "streamed"
    if message == "approve":
        draft = await ctx.step("draft", lambda: "draft-1")
        answer = await ctx.interrupt({"question": "ship it?", "draft": draft})
        return f"{draft} -> {answer}"
    if message == "whoami":
        return f"user={ctx.user}"
    if message == "ask the model":
        return (await ctx.llm.complete([{"role": "user", "content": "Say hi."}], max_tokens=3))["text"]
    return "echo: " + message
'''


def agent_archive(tmp_path: Path, name: str = "echo", body: str = AGENT, version: str = "") -> bytes:
    """An agent directory packed as the tar.gz a client uploads."""
    import io
    import tarfile
    import textwrap

    root = tmp_path / f"agent-src-{name}{version}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(body).replace("echo: ", f"echo{version}: "))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


@pytest.fixture
async def runtime(tmp_path: Path, store: Store):
    from moorage.lifecycle.manager import InstanceManager
    from moorage.llm import gateway_from_config
    from moorage.runtime.runtime import Runtime
    from moorage.sandbox.process import ProcessDriver

    cfg = Config(data_dir=tmp_path / "rt", sandbox_driver="process")
    driver = ProcessDriver(cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    yield rt
    await rt.aclose()  # its background work ends before what it uses closes
    await manager.close()
    await stop_all_sandboxes(driver)
    await driver.close()


@pytest.fixture
async def live_rt(tmp_path: Path, runtime: Any):
    """A live uvicorn server over the real runtime, served on the test's own event loop (the runtime's
    locks and background tasks live there), used with async clients."""
    async with serve_runtime(runtime, Config(data_dir=tmp_path / "data")) as live:
        yield live


@contextlib.asynccontextmanager
async def serve_runtime(runtime: Any, config: Config) -> AsyncIterator[LiveServer]:
    """``live_rt`` with the server's own ``config``."""
    import asyncio

    app = create_app(runtime, config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, config.data_dir)
    finally:
        server.should_exit = True
        await task


def aclient(live: LiveServer, secret: str | None = None, **headers: str) -> httpx.AsyncClient:
    h = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.AsyncClient(base_url=live.url, headers={**h, **headers}, timeout=120)


async def sse_events(c: httpx.AsyncClient, method: str, path: str, *, stop_after: int | None = None,
                     **kw: Any) -> list[tuple[str, Any]]:
    """The (event, data) pairs of a server-sent event stream the request answers with (200), up to ``stop_after``
    (then the connection closes, as a caller that leaves)."""
    import json

    out: list[tuple[str, Any]] = []
    async with c.stream(method, path, **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.status_code
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((str(event), json.loads(line[len("data: "):])))
                if stop_after is not None and len(out) >= stop_after:
                    return out
    return out
