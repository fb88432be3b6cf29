"""A live host as ``moorage up`` builds it (process sandboxes, its background loops, the real HTTP server on
loopback), and a scrape of its ``/metrics`` read as a monitoring system reads it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from moorage.api import create_app
from moorage.config import Config
from moorage.runtime.host import Host
from tests.api.conftest import free_port

AGENT = '''
async def on_message(ctx, message):
    if message == "fail":
        raise RuntimeError("the agent failed on purpose")
    if message == "approve":
        return f"approved: {await ctx.interrupt({'question': 'ship it?'})}"
    return "echo: " + message
'''


def archive(name: str = "echo", body: str = AGENT) -> bytes:
    files = {"moorage.toml": f'[agent]\nname = "{name}"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n',
             "agent.py": body}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for fname, text in files.items():
            info = tarfile.TarInfo(fname)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


@dataclass
class LiveHost:
    host: Host
    url: str
    data_dir: Path
    key: str  # a tenant key

    def client(self, secret: str | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=120,
                                 headers={"Authorization": f"Bearer {secret or self.key}"})

    async def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``: (name, sorted labels) -> value, read with the metrics token."""
        token = (self.data_dir / "api" / "metrics-token").read_text().strip()
        async with self.client(token) as c:
            r = await c.get("/metrics")
        assert r.status_code == 200, r.text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    async def families(self) -> set[str]:
        """The names of the metric families ``/metrics`` shows (``_total``, ``_bucket`` … folded)."""
        token = (self.data_dir / "api" / "metrics-token").read_text().strip()
        async with self.client(token) as c:
            r = await c.get("/metrics")
        return {fam.name for fam in text_string_to_metric_families(r.text)}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@pytest.fixture
async def live_host(tmp_path: Path) -> AsyncIterator[LiveHost]:
    async with start_host(tmp_path) as live:
        yield live


@contextlib.asynccontextmanager
async def start_host(tmp_path: Path, **settings: Any) -> AsyncIterator[LiveHost]:
    """``live_host`` with ``settings`` of its ``Config`` on top."""
    cfg = Config(**{"data_dir": tmp_path / "data", "sandbox_driver": "process", "max_awake_instances": 8, **settings})
    host = Host.open(cfg)
    await host.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(host.runtime, cfg), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        _, key = host.store.operator.create_tenant("acme")
        yield LiveHost(host, f"http://127.0.0.1:{port}", cfg.data_dir, key.secret)
    finally:
        server.should_exit = True
        await task
        await host.close()
