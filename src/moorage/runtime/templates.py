"""Template snapshots per deployment: a booted guest with the agent's code loaded, ready to fork.

Templates are host-local files (under ``<data_dir>/templates``); any host rebuilds a missing one from the
deployment's package, so the store stays the only source of truth.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moorage.errors import MoorageError
from moorage.log import get_logger
from moorage.runtime.package import AgentPackageError, unpack
from moorage.sandbox import RemoteError, Sandbox, SandboxDriver, TemplateRef
from moorage.store import Deployment

log = get_logger(__name__)

#: Where a deployment's files live inside every sandbox.
AGENTS_DIR_IN_GUEST = "/work/.moorage/agents"


def agent_dir(deployment_id: str) -> str:
    return f"{AGENTS_DIR_IN_GUEST}/{deployment_id}"


class AgentLoadFailed(AgentPackageError):
    """The agent's code imported badly inside a sandbox (ImportError, missing handler, ...)."""

    code = "agent-load-failed"


async def push_and_load(sandbox: Sandbox, deployment: Deployment, archive: bytes) -> dict[str, Any]:
    """Make ``deployment`` the agent version loaded in ``sandbox`` (files written first if missing)."""
    base = agent_dir(deployment.id)
    if await sandbox.stat(f"{base}/moorage.toml") is None:
        for name, data in sorted(unpack(archive).items()):
            await sandbox.write_file(f"{base}/{name}", data)
    try:
        return await sandbox.channel.call("agent.load", {"deployment_id": deployment.id, "path": base}, timeout=120)
    except RemoteError as e:
        detail = (e.data or {}).get("traceback", "") if isinstance(e.data, dict) else ""
        raise AgentLoadFailed(f"{e.message}", hint=(detail.strip().splitlines() or ["fix the agent and deploy again"])[-1]) from e


class Templates:
    def __init__(self, root: Path, driver: SandboxDriver, packages: Path) -> None:
        self.root = root
        self.driver = driver
        self.packages = packages
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, asyncio.Lock] = {}

    def archive(self, deployment: Deployment) -> bytes:
        path = self.packages / f"{deployment.package_sha256}.tar.gz"
        if not path.exists():
            raise MoorageError(f"package of deployment {deployment.number} is missing on this host ({path})",
                               hint="deploy the agent again")
        return path.read_bytes()

    def _meta(self, deployment_id: str) -> Path:
        return self.root / f"{deployment_id}.json"

    def cached(self, deployment_id: str) -> TemplateRef | None:
        p = self._meta(deployment_id)
        if not p.exists():
            return None
        d = json.loads(p.read_text())
        if d.get("driver") != self.driver.name or not Path(d["path"]).exists():
            return None
        return TemplateRef(d["id"], d["driver"], Path(d["path"]), d.get("source_sandbox"), d.get("created_at", 0.0),
                           d.get("includes_memory", False))

    async def ensure(self, deployment: Deployment, on_progress: Any = None) -> TemplateRef:
        """The deployment's template, built now if this host has none (single-flight per deployment)."""
        lock = self._locks.setdefault(deployment.id, asyncio.Lock())
        async with lock:
            ref = self.cached(deployment.id)
            if ref is not None:
                return ref
            return await self._build(deployment, on_progress)

    async def _build(self, deployment: Deployment, on_progress: Any) -> TemplateRef:
        def say(msg: str) -> None:
            log.info(msg, deployment=deployment.id)
            if on_progress:
                on_progress(msg)

        builder_id = f"tpl-{deployment.id[:24]}"
        if builder_id in await self.driver.list():
            await (await self.driver.open(builder_id)).destroy()
        say("starting a sandbox for the template")
        sb = await self.driver.create(builder_id)
        try:
            await sb.start()
            say("loading the agent's code")
            await push_and_load(sb, deployment, self.archive(deployment))
            say("snapshotting the template")
            ref = await self.driver.make_template(sb, f"dep-{deployment.id[:24]}")
        finally:
            await sb.destroy()
        meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(ref).items()}
        tmp = self._meta(deployment.id).with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(self._meta(deployment.id))
        say("template ready")
        return ref
