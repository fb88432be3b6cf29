"""Three `moorage up` processes, one PostgreSQL database and one S3 server (SeaweedFS): a fleet on one machine.

Each host has its own data directory and port, as separate machines would; the process driver keeps the suite
fast (the fleet's logic does not depend on the driver; the microvm driver cannot ship snapshots yet).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.store import open_store

ROOT = Path(__file__).resolve().parents[2]
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


class Host:
    def __init__(self, name: str, data: Path, env: dict[str, str]) -> None:
        self.name, self.data = name, data
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        self.log = data.parent / f"{name}.log"
        full = {**os.environ, **env, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port),
                "MOORAGE_HOST_ID": name, "MOORAGE_HOST_URL": self.url, "MOORAGE_SANDBOX_DRIVER": "process",
                "MOORAGE_LOG_LEVEL": "info"}
        self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=full, cwd=ROOT,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, f"{name} did not come up: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        self.key = (data / "local-admin.key").read_text().strip()

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    def kill(self) -> None:
        """The machine dies: the host process and every sandbox process it started."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in _pids_under(self.data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        for pid in _pids_under(self.data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids_under(data: Path) -> list[int]:
    """Processes whose command line names a path under ``data`` (a host's sandboxes)."""
    out = []
    needle = str(data).encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                continue
    return out


class Fleet:
    def __init__(self, base: Path, store_url: str, s3: dict[str, str], n: int = 3, **settings: str) -> None:
        self.base, self.store_url = base, store_url
        env = {"MOORAGE_STORE_URL": store_url, "MOORAGE_LEASE_TTL_S": "4", "MOORAGE_HEARTBEAT_S": "1",
               **{f"MOORAGE_{k.upper()}": v for k, v in s3.items()}, **settings}
        self.hosts: list[Host] = []
        for i in range(n):
            self.hosts.append(Host(f"h{i + 1}", base / f"h{i + 1}", env))
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
