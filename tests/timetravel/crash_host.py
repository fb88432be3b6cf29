"""A host for the crash tests, run as its own process: ``setup`` (deploy, four turns), or a rollback / fork
that SIGKILLs its own process inside the operation, between its sandbox half and its store half.

The sandbox driver (``process`` or ``microvm``) is chosen at setup and kept in the data directory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.sandbox import SandboxDriver
from moorage.store import EntityKey, open_store
from moorage.store.repos.checkpoints import Checkpoints

AGENT = '''
async def on_message(ctx, message):
    if message == "ls":
        return ",".join(sorted(ctx.files.list("notes")))
    n = int(message.split()[1])
    ctx.files.write(f"notes/{n}.txt", message)
    await ctx.memory.learn("user", "turn", str(n), f"turn {n}")
    return f"done {n}"
'''


@asynccontextmanager
async def host(data: Path) -> AsyncIterator[tuple[Runtime, Any]]:
    """A runtime over ``data`` (SQLite, process sandboxes), its tenant created on first use."""
    name = (data / "driver").read_text()
    cfg = Config(data_dir=data, sandbox_driver=name)
    store = open_store(cfg)
    key_file = data / "tenant.key"
    if not key_file.exists():
        key_file.write_text(store.operator.create_tenant("acme")[1].secret)
    principal = store.authenticate(key_file.read_text())
    driver = _driver(name, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    try:
        yield rt, principal
    finally:
        await rt.aclose()  # its background work ends before what it uses closes
        await manager.close()
        for sid in await driver.list():
            sb = await driver.open(sid)
            if sb.state.value == "running":
                await sb.stop()
        await driver.close()
        store.close()


def _driver(name: str, cfg: Config) -> SandboxDriver:
    if name == "microvm":
        from moorage.sandbox.microvm import MicroVMDriver

        # The guest image the test suite builds once (tests/sandbox/conftest.py).
        images = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
        return MicroVMDriver(cfg.sandboxes_dir, cfg, images_dir=images)
    from moorage.sandbox.process import ProcessDriver

    return ProcessDriver(cfg.sandboxes_dir, cfg)


def _die(*_: Any, **__: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


async def main(data: Path, phase: str) -> None:
    async with host(data) as (rt, who):
        if phase == "setup":
            src = data / "agent"
            src.mkdir()
            (src / "moorage.toml").write_text('[agent]\nname = "tt"\nentry = "agent.py"\n[agent.timetravel]\nauto = true\n'
                                              '[agent.lifecycle]\nusers = "auto"\n')
            (src / "agent.py").write_text(AGENT)
            await rt.deploy(who, src)
            for n in range(1, 5):
                await rt.invoke(who, EntityKey("tt", "ada"), f"turn {n}")
            await rt.timetravel.settled(rt.store.tenant(who).tenant_id, "tt", "ada")  # turn 4's, after its reply
            cks = Checkpoints(rt.store.tenant(who)).list("tt", "ada")
            print(json.dumps({c.summary["turn"]["message"]: c.id for c in cks}))
            return
        target = sys.argv[3]
        if phase == "rollback":  # killed after the sandbox rolled back, before the store's transaction
            Checkpoints.rollback = _die  # type: ignore[method-assign]
            await rt.timetravel.rollback(who, "tt", "ada", target)
        if phase == "fork":  # killed while the source sandbox is at the checkpoint, before it goes back
            rt.driver.make_template = _die  # type: ignore[method-assign]
            await rt.timetravel.fork(who, "tt", "ada", target, ["bea"])


if __name__ == "__main__":
    if sys.argv[2] == "setup":
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        (Path(sys.argv[1]) / "driver").write_text(sys.argv[3])
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
