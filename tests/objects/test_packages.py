"""Deployment packages through the object store: one host deploys, another that lacks the package fetches it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from moorage.config import Config
from moorage.devservices.seaweedfs import SeaweedFS
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.objects import sha256_file
from moorage.runtime.runtime import Runtime
from moorage.store import EntityKey, open_store
from tests.conftest import stop_all_sandboxes
from tests.runtime.conftest import write_agent
from tests.sandbox.conftest import DRIVER_FACTORIES

AGENT = '''
async def on_message(ctx, message):
    return "echo: " + message
'''


async def test_a_host_without_the_package_fetches_it_from_the_object_store(
        tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str) -> None:
    prefix = f"pkg-{uuid.uuid4().hex[:8]}"
    settings: dict[str, Any] = seaweedfs.settings(s3_bucket, prefix)
    store = open_store(Config(data_dir=tmp_path / "db"))  # the database both hosts share
    _, key = store.operator.create_tenant("acme")
    principal = store.authenticate(key.secret)
    hosts: list[tuple[Runtime, InstanceManager, Any]] = []
    try:
        for name in ("a", "b"):  # two hosts, each with a data directory of its own
            cfg = Config(data_dir=tmp_path / name, sandbox_driver="process", **settings)
            driver = DRIVER_FACTORIES["process"](cfg.sandboxes_dir, cfg)
            manager = InstanceManager(store, driver)
            await manager.start()
            hosts.append((Runtime(cfg, store, driver, gateway_from_config(cfg), manager), manager, driver))
        (a, _, _), (b, _, _) = hosts

        dep = await a.deploy(principal, write_agent(tmp_path / "agent", "echo", AGENT))
        name = f"{dep.package_sha256}.tar.gz"
        local_a, local_b = tmp_path / "a" / "packages" / name, tmp_path / "b" / "packages" / name
        head = seaweedfs.client().head_object(Bucket=s3_bucket, Key=f"{prefix}/packages/{name}")
        assert head["Metadata"]["sha256"] == dep.package_sha256 == sha256_file(local_a)
        assert not local_b.exists()

        # Host b builds its own template for the deployment from the package it fetches.
        r = await b.invoke(principal, EntityKey("echo", "bob"), "hello")
        assert (r.status, r.reply) == ("done", "echo: hello")
        assert sha256_file(local_b) == dep.package_sha256
        assert (local_b.stat().st_mode & 0o777) == 0o600
    finally:
        for rt, manager, driver in hosts:
            await rt.aclose()  # its background work ends before what it uses closes
            await manager.close()
            await stop_all_sandboxes(driver)
            await driver.close()
        store.close()
