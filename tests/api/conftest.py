"""API test fixtures: a real uvicorn server on 127.0.0.1 (free port) over the real store, and clients.

The server runs in a thread of the test process, so tests can also look at the store directly.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import uvicorn

from moorage.api import create_app
from moorage.config import Config
from moorage.store import Store


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
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


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
