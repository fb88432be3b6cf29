"""A redeploy reaches the users who already have an instance: on the first load of the new deployment into their
sandbox, before its code is imported, the sandbox takes the deployment's packages and environment.

An instance keeps the sandbox it was forked from (docs/fleet.md), so its deploy-time packages (``requirements.txt``,
``deploy_packages.SITE_DIR``) and its environment (``templates.boot_env``: the network's proxy settings, the
packages' path) are those of that template. When the deployment being loaded asks for others (the sandbox's
``deploy_packages.MARKER`` differs from the deployment's digest, or the driver's ``boot_env`` from the deployment's):

- a driver whose forks bind their template's packages (process) binds the new template's instead (``bind_shared``):
  nothing is copied, and the instance's record names that template so the fleet's collector keeps it;
- otherwise (a micro-VM: the packages are on the instance's own disk, or a process template made before templates
  shared them) the old packages are removed and the new ones installed into the sandbox, from this host's package
  cache (filled when the template was built here; in a fleet, fetched from what the template's builder published
  beside it), else by pip through the gateway as at deploy time (which needs the sandbox's relay);
- the sandbox's environment becomes the deployment's (``set_boot_env``);

and the sandbox is restarted before the code is loaded, so no module of the old versions stays imported (C
extensions cannot be unloaded) and its processes start with the new environment. Its files stay; its processes do
not (a micro-VM boots cold, once). Every step can be repeated: the marker is written last, so an interrupted
change is made again on the next load.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

from moorage.errors import ConflictError
from moorage.log import get_logger
from moorage.runtime import deploy_packages
from moorage.runtime.package import unpack
from moorage.runtime.templates import boot_env, push_and_load
from moorage.sandbox import GuestFileNotFound, Sandbox

log = get_logger(__name__)

#: The key of an instance record's meta naming the template whose shared directories its sandbox binds, when that
#: is not the template it was forked from (``fleet/gc.template_use`` keeps it).
SHARED_TEMPLATE = "shared_template"

_locks: dict[str, asyncio.Lock] = {}


async def installed(sandbox: Sandbox) -> str | None:
    """The digest of the requirements the sandbox's packages came from; None when it has no complete set."""
    try:
        return (await sandbox.read_file(deploy_packages.MARKER, max_bytes=256)).decode(errors="replace").strip()
    except GuestFileNotFound:
        return None


async def load(rt: Any, sandbox: Sandbox, deployment: Any, ts: Any,
               on_restart: Callable[[Any], Any] | None = None) -> bool:
    """``push_and_load`` of ``deployment`` into ``sandbox``, its packages and environment made the deployment's
    first. Returns whether the sandbox was restarted for them; ``on_restart`` gets its new channel before the code
    is loaded."""
    archive = await asyncio.to_thread(rt.templates.archive, deployment)
    restarted = await ensure(rt, sandbox, deployment, archive, ts)
    if restarted and on_restart is not None:
        res = on_restart(sandbox.channel)
        if inspect.isawaitable(res):
            await res
    await push_and_load(sandbox, deployment, archive)
    return restarted


async def ensure(rt: Any, sandbox: Sandbox, deployment: Any, archive: bytes, ts: Any) -> bool:
    """Make the sandbox's packages and environment those of ``deployment`` (see the module); returns whether it was
    restarted."""
    requirements = deploy_packages.requirements_of(unpack(archive))
    wanted, env = deploy_packages.digest(requirements), boot_env(deployment.manifest, requirements)
    driver = rt.driver
    if (await installed(sandbox) or "") == wanted and driver.boot_env(sandbox) == env:
        return False
    async with _locks.setdefault(sandbox.id, asyncio.Lock()):
        have = await installed(sandbox)
        packages, env_changed = (have or "") != wanted, driver.boot_env(sandbox) != env
        if not (packages or env_changed):  # another load did it meanwhile
            return False
        started = time.perf_counter()
        ref = await rt.templates.ensure(deployment)
        if packages and have is None and wanted:
            # No marker: packages from a template made before markers were written (or none). If the sandbox was
            # forked from, or binds, the deployment's own template, it has that template's packages already.
            rec = await asyncio.to_thread(ts.sandboxes.get, sandbox.id)
            packages = (rec.meta.get(SHARED_TEMPLATE) or rec.meta.get("template")) != ref.id
            if not (packages or env_changed):
                return False
        shares = packages and driver.capabilities.shares_template_dirs
        restart_s = 0.0

        async def restart() -> list[str]:
            """Stop the sandbox, give it the new environment and bound directories, start it; returns what it binds
            from the template when ``shares``."""
            nonlocal restart_s
            t = time.perf_counter()
            await sandbox.stop()
            if env_changed:
                await driver.set_boot_env(sandbox, env)
            bound = await driver.bind_shared(sandbox, ref) if shares else []
            await sandbox.start()
            restart_s += time.perf_counter() - t
            return bound

        async def install() -> str:
            """The deployment's packages into the sandbox's own files (none left if it has none)."""
            await sandbox.exec(["rm", "-rf", deploy_packages.SITE_DIR], timeout=300)
            if not requirements:
                return "removed"
            return await rt.templates.install_packages(sandbox, requirements, deployment.agent_id,
                                                       lambda msg: log.info(msg, sandbox=sandbox.id), template=ref)

        how = "unchanged"
        if shares:
            await asyncio.to_thread(_name_shared_template, ts, sandbox.id, ref.id)
            how = "bound from the template" if requirements else "unbound"
            bound = await restart()
            if requirements and deploy_packages.SITE_DIR not in bound:
                how = await install()  # a process template made before templates shared their packages
                env_changed = False
                await restart()
        else:
            if packages:
                how = await install()
            await restart()
        ms = (time.perf_counter() - started) * 1000
        log.info("instance changed with its deployment", sandbox=sandbox.id, deployment=deployment.id,
                 template=ref.id, packages=how, env=env_changed, restart_ms=round(restart_s * 1000, 1),
                 ms=round(ms, 1))
        return True


def _name_shared_template(ts: Any, sandbox_id: str, template_id: str) -> None:
    """The instance's record names the template its sandbox is about to bind, before it does (a host that dies in
    between leaves one template kept too long, never one collected while bound). Blocking."""
    for _ in range(10):
        rec = ts.sandboxes.get(sandbox_id)
        if rec.meta.get(SHARED_TEMPLATE) == template_id:
            return
        try:
            ts.sandboxes.update(sandbox_id, expected_version=rec.version, meta={**rec.meta, SHARED_TEMPLATE: template_id})
            return
        except ConflictError:
            continue
    raise ConflictError(f"instance {sandbox_id} kept changing; its packages were not changed", hint="retry the turn")
