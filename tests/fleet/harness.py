"""Three `moorage up` processes, one PostgreSQL database and one S3 server (SeaweedFS): a fleet on one machine.

Each host has its own data directory and port, as separate machines would; the process driver keeps the suite
fast (the fleet's logic does not depend on the driver; the microvm driver cannot ship snapshots yet).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost, fleet_env
from moorage.store import open_store

AGENT_PY = '''\
import asyncio

async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    if message == "slow":
        await asyncio.sleep(4)
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def write_agent(base: Path) -> Path:
    d = base / "echo"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (d / "agent.py").write_text(AGENT_PY)
    return d


class Fleet:
    def __init__(self, base: Path, store_url: str, s3: dict[str, str], n: int = 3, **settings: str) -> None:
        self.base, self.store_url = base, store_url
        env = fleet_env(store_url, s3, lease_ttl_s="4", heartbeat_s="1", **settings)
        self.hosts: list[LocalHost] = []
        for i in range(n):
            self.hosts.append(LocalHost(f"h{i + 1}", base / f"h{i + 1}", env, start_timeout_s=120))
        self.key = self.hosts[0].key
        self.api = [h.client(self.key) for h in self.hosts]

    def deploy(self) -> None:
        r = self.api[0].post("/v1/agents/echo/deployments", content=tar_dir(write_agent(self.base)),
                             headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    def turn(self, i: int, user: str, text: str = "hi") -> httpx.Response:
        return self.api[i].post("/v1/agents/echo/invoke", json={"message": text, "user": user})

    def records(self) -> dict[str, Any]:
        store = open_store(Config(store_url=self.store_url))
        try:
            return {r.scope.user: r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=10000)}
        finally:
            store.close()

    def spans(self, name: str) -> list[Any]:
        store = open_store(Config(store_url=self.store_url))
        try:
            return [s for ts in store.operator.tenants() for s in ts.spans.recent(limit=100000) if s.name == name]
        finally:
            store.close()

    def close(self) -> None:
        for c in self.api:
            c.close()
        for h in self.hosts:
            h.stop()
