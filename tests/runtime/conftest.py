"""A real runtime for tests: SQLite store, process sandboxes, the instance manager, the embedded model."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest

from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.sandbox import SandboxDriver
from moorage.store import Principal, Store, open_store
from tests.conftest import stop_all_sandboxes


class Env:
    def __init__(self, runtime: Runtime, manager: InstanceManager, principal: Principal, cfg: Config) -> None:
        self.runtime = runtime
        self.manager = manager
        self.principal = principal
        self.cfg = cfg

    @property
    def store(self) -> Store:
        return self.runtime.store


async def make_env(tmp_path: Path, driver_name: str = "process",
                   factory: Callable[[Path, Config], SandboxDriver] | None = None) -> AsyncIterator[Env]:
    """A runtime on one sandbox driver of the sandbox suite's ``DRIVER_FACTORIES`` (or one ``factory`` makes, of
    that driver's kind), torn down after the test."""
    from tests.sandbox.conftest import DRIVER_FACTORIES

    # The operator policy of these tests: "the internet" is loopback servers the tests start (egress refuses
    # loopback by default; docs/egress.md).
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver=driver_name, egress_allow_cidrs="127.0.0.0/8")
    store = open_store(cfg)
    _, key = store.operator.create_tenant("acme")
    principal = store.authenticate(key.secret)
    driver = (factory or DRIVER_FACTORIES[driver_name])(cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    try:
        yield Env(rt, manager, principal, cfg)
    finally:
        # The runtime's background work (a checkpoint after the last reply, the embedding of the last turn's
        # messages) ends first: it uses the instances, the driver and the store closed below.
        await rt.aclose()
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


def write_agent(root: Path, name: str, body: str, extra_manifest: str = "") -> Path:
    """An SDK agent directory: ``agent.py`` (dedented ``body``) and a manifest whose users are created on first
    contact; ``extra_manifest`` (TOML tables) goes between ``[agent]`` and ``[agent.lifecycle]``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n{extra_manifest}'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(body))
    return root


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "process"):
        yield e


async def earlier_fork_template(runtime: Runtime, tenant_id: str, sandbox_id: str, agent: str, user: str) -> tuple[Path, object]:
    """A fork template as earlier versions' sandbox `fork` verb left them on a host (a template of the user's
    instance, and ``forks/<template>.json`` naming the user): what an upgraded host must still clean up."""
    import json
    import uuid

    from moorage.runtime.private_files import write_private
    from moorage.runtime.templates import _ref_json

    sb = await runtime.driver.open(sandbox_id)
    ref = await runtime.driver.make_template(sb, f"fork-{uuid.uuid4().hex[:12]}")
    record = runtime.templates._forks_dir() / f"{ref.id}.json"
    write_private(record, json.dumps({"template": _ref_json(ref), "tenant_id": tenant_id, "agent": agent,
                                      "user": user, "sandbox_id": sandbox_id}).encode())
    return record, ref
