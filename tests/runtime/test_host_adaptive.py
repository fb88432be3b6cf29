"""``sleep = "adaptive"`` through the host ``moorage up`` runs (``Host.open``), over HTTP: turns succeed (the
instance manager has prices to weigh), the instance sleeps, and what it learned is still known after a restart."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import httpx
import pytest
import uvicorn

from moorage.api import create_app
from moorage.config import Config
from moorage.runtime.host import Host
from moorage.store import Scope
from tests.api.conftest import free_port

AGENT = 'async def on_message(ctx, message):\n    return "adaptive: " + message\n'


def archive() -> bytes:
    files = {"moorage.toml": '[agent]\nname = "habit"\nentry = "agent.py"\n'
                             '[agent.lifecycle]\nusers = "auto"\nsleep = "adaptive"\n',
             "agent.py": AGENT}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


async def serve(host: Host, cfg: Config) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(host.runtime, cfg), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


@pytest.mark.timeout(240)
async def test_adaptive_agent_served_by_the_host(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")
    host = Host.open(cfg)
    await host.start()
    server, task, url = await serve(host, cfg)
    try:
        _, key = host.store.operator.create_tenant("acme")
        h = {"Authorization": f"Bearer {key.secret}"}
        async with httpx.AsyncClient(base_url=url, headers=h, timeout=120) as c:
            r = await c.post("/v1/agents/habit/deployments", content=archive(), headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
            for word in ("one", "two"):
                r = await c.post("/v1/agents/habit/invoke", json={"message": word, "user": "ada"})
                assert r.status_code == 200, r.text  # before the fix: "the adaptive policy needs prices"
                assert r.json()["reply"] == f"adaptive: {word}"
        ts = host.store.tenant(host.store.authenticate(key.secret))
        li = host.manager.live(ts, Scope.for_user("habit", "ada"))
        assert li is not None and li.policy.name == "adaptive" and li.activity.turns == 2
        assert li.activity.gaps.count == 1
    finally:
        server.should_exit = True
        await task
        await host.close()  # a clean stop puts the instance to sleep, with what it learned in its record

    host2 = Host.open(cfg)
    await host2.start()
    server, task, url = await serve(host2, cfg)
    try:
        ts2 = host2.store.tenant(host2.store.authenticate(key.secret))
        rec = ts2.sandboxes.for_scope(Scope.for_user("habit", "ada"))
        assert rec is not None and rec.state == "sleeping"
        assert rec.meta["activity"]["turns"] == 2 and rec.meta["activity"]["gaps"]["count"] == 1
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=120) as c:
            r = await c.post("/v1/agents/habit/invoke", json={"message": "three", "user": "ada"})
            assert r.status_code == 200 and r.json()["reply"] == "adaptive: three"
        li = host2.manager.live(ts2, Scope.for_user("habit", "ada"))
        assert li is not None and li.activity.turns == 3 and li.activity.gaps.count == 1  # learned before the restart
    finally:
        server.should_exit = True
        await task
        await host2.close()
