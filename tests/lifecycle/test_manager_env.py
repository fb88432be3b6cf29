"""Shared fixtures for the lifecycle and router tests (no tests here): a real store, real sandboxes, a template.

``lc_env`` runs on every driver in the sandbox suite's ``DRIVER_FACTORIES`` (and both store backends); tests of
behaviour no driver changes narrow it with ``@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.router import Router
from moorage.sandbox import Sandbox, SandboxDriver, TemplateRef
from moorage.store import Agent, Span, Store, TenantStore
from tests.sandbox.conftest import DRIVER_FACTORIES

TEMPLATE_FILE = "from-template.txt"


async def forward(sandbox: Sandbox, turn: dict[str, Any]) -> Any:
    """A real turn: operations on the sandbox's channel, as the runtime's forward will do."""
    op = turn["op"]
    if op == "echo":
        r = await sandbox.exec(["echo", turn["text"]])
        return r.stdout_text.strip()
    if op == "write":
        await sandbox.write_file(turn["path"], turn["data"].encode())
        return "ok"
    if op == "read":
        return (await sandbox.read_file(turn["path"])).decode()
    if op == "append":  # read-modify-write: interleaved turns would lose lines
        script = 'c=$(cat log 2>/dev/null); sleep "$1"; { [ -n "$c" ] && echo "$c"; echo "$2"; } > log'
        r = await sandbox.exec(["/bin/sh", "-c", script, "append", str(turn.get("pause", 0)), turn["text"]])
        assert r.ok, r.stderr_text
        return turn["text"]
    if op == "hold":
        r = await sandbox.exec(["sleep", str(turn["seconds"])])
        return r.ok
    raise ValueError(op)


@dataclass
class LcEnv:
    store: Store
    ts: TenantStore
    driver_name: str
    root: Path
    config: Config
    template: TemplateRef
    managers: list[InstanceManager] = field(default_factory=list)
    drivers: list[SandboxDriver] = field(default_factory=list)

    def driver(self) -> SandboxDriver:
        d = DRIVER_FACTORIES[self.driver_name](self.root, self.config)
        self.drivers.append(d)
        return d

    def manager(self, **kw: Any) -> InstanceManager:
        kw.setdefault("host_id", "host-a")
        m = InstanceManager(self.store, self.driver(), **kw)
        self.managers.append(m)
        return m

    def router(self, manager: InstanceManager, **kw: Any) -> Router:
        async def templates(ts: TenantStore, agent: Agent) -> TemplateRef:
            return self.template

        return Router(self.store, manager, forward, templates, **kw)

    def agent(self, name: str = "helper", **lifecycle: Any) -> Agent:
        return self.ts.agents.create(name, {"lifecycle": lifecycle})

    def spans(self, name: str) -> list[Span]:
        return [s for s in self.ts.spans.recent(limit=100_000) if s.name == name]


#: Every driver on SQLite, and the process driver on PostgreSQL too: the store backend is orthogonal to the
#: driver (the store suite covers both backends), and micro-VM boots under TCG are what CI time is made of.
FULL_MATRIX = [*(f"{d}-sqlite" for d in sorted(DRIVER_FACTORIES)), "process-postgres"]
#: For behaviour that does not depend on the driver (turn ordering, 409/429, placement rules).
PROCESS_ONLY = ["process-sqlite", "process-postgres"]


async def _lc_env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LcEnv]:
    from tests.conftest import make_backend

    driver_name, backend = request.param.split("-")
    store = Store(make_backend(backend, tmp_path, request), max_value_bytes=64 * 1024)
    _, key = store.operator.create_tenant("acme")
    tenant = store.tenant(store.authenticate(key.secret))
    root = tmp_path / "sandboxes"
    cfg = Config(data_dir=tmp_path / "data")
    factory = DRIVER_FACTORIES[driver_name]
    drv = factory(root, cfg)
    sb = await drv.create("template-src")
    await sb.start()
    await sb.write_file(TEMPLATE_FILE, b"prepared in the template")
    tpl = await drv.make_template(sb, "tpl-helper")
    await sb.destroy()
    env = LcEnv(store, tenant, driver_name, root, cfg, tpl, drivers=[drv])
    try:
        yield env
    finally:
        for m in env.managers:
            await m.close()
        for d in env.drivers:
            await d.close()
        cleaner = factory(root, cfg)
        for sid in await cleaner.list():
            await (await cleaner.open(sid)).destroy()
        await cleaner.close()
        store.close()


@pytest.fixture(params=FULL_MATRIX)
async def lc_env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LcEnv]:
    async for env in _lc_env(request, tmp_path):
        yield env
