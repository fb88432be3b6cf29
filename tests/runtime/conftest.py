"""A real runtime for tests: SQLite store, process sandboxes, the instance manager, the embedded model."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.sandbox.process import ProcessDriver
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


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")
    store = open_store(cfg)
    _, key = store.operator.create_tenant("acme")
    principal = store.authenticate(key.secret)
    driver = ProcessDriver(cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    yield Env(rt, manager, principal, cfg)
    await manager.close()
    await stop_all_sandboxes(driver)
    await driver.close()
    store.close()
