"""Shared fixtures for the lifecycle and router tests (no tests here): a real store, real sandboxes, a template.

``lc_env`` runs on every store backend and every driver in the sandbox suite's ``DRIVER_FACTORIES``.
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


@pytest.fixture(params=sorted(DRIVER_FACTORIES))
async def lc_env(request: pytest.FixtureRequest, store: Store, tenant: TenantStore, tmp_path: Path) -> AsyncIterator[LcEnv]:
    root = tmp_path / "sandboxes"
    cfg = Config(data_dir=tmp_path / "data")
    factory = DRIVER_FACTORIES[request.param]
    drv = factory(root, cfg)
    sb = await drv.create("template-src")
    await sb.start()
    await sb.write_file(TEMPLATE_FILE, b"prepared in the template")
    tpl = await drv.make_template(sb, "tpl-helper")
    await sb.destroy()
    env = LcEnv(store, tenant, request.param, root, cfg, tpl, drivers=[drv])
    yield env
    for m in env.managers:
        await m.close()
    for d in env.drivers:
        await d.close()
    cleaner = factory(root, cfg)
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()
    await cleaner.close()
