"""A redeploy reaches the users who already have an instance: on the first load of the new deployment into their
sandbox, before its code is imported, the sandbox takes the deployment's packages and environment.

An instance keeps the sandbox it was forked from (docs/fleet.md), so its deploy-time packages (``requirements.txt``,
``deploy_packages.SITE_DIR``; ``[agent] apt``, Debian packages), and its environment (``templates.boot_env``: the
network's proxy settings, the packages' path) are those of that template. When the deployment being loaded asks
for others (the sandbox's ``deploy_packages.MARKER`` differs from the deployment's digest, its
``deploy_apt.MARKER`` from the deployment's list, or the driver's ``boot_env`` from the deployment's):

- a driver whose forks bind their template's packages (process) binds the new template's instead (``bind_shared``):
  nothing is copied, and the instance's record names that template so the fleet's collector keeps it; the
  sandbox restarts with them;
- otherwise (a micro-VM: the packages are on the instance's own disk, or a process template made before templates
  shared them), a sandbox whose environment changed restarts with the new one first, so its relay carries the
  downloads below and no process keeps the old environment (in place where the driver can, ``restart_in_place``:
  a micro-VM's guest kills every other process and forks a fresh supervisor, unless the NIC comes or
  goes, which needs a boot); the old packages are removed and the new ones installed into the sandbox, from this
  host's package cache (filled when the template was built here; in a fleet, fetched from what the template's
  builder published beside it), else by pip through the gateway as at deploy time; the Debian packages the list
  added are installed (the host's cache, else apt-get through the gateway) and the ones it dropped purged
  (``deploy_apt.update``); a sandbox not restarted yet whose Python packages changed restarts now, so no module
  of the old ones stays imported (C extensions cannot be unloaded).

An agent with an app (``[agent] ports``) whose sandbox has an older deployment's code loaded restarts too, so its app
is the new code's: a server its module started when it was loaded holds the port, and the new module, loaded beside
it, could not take it (the old page served on after every redeploy, on micro-VMs across sleeps too).

Before it touches the sandbox, a change waits (up to ``DRAIN_S``) for the agent turns running in it to end
(``in_turn``: another of the user's sessions, still on the old deployment), so a restart does not cut them; turns
that start meanwhile load the new deployment and wait for the change.

A change of the Debian packages alone restarts nothing (as an ``apt-get install`` on a running machine: processes
running keep the binaries they started with). Files stay; processes do not survive a restart. Every step can be
repeated: each marker is written last, so an interrupted change is made again on the next load.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import weakref
from typing import Any, Callable, Iterator

from moorage.errors import ConflictError
from moorage.log import get_logger
from moorage.runtime import deploy_apt, deploy_packages
from moorage.runtime.package import unpack
from moorage.runtime.templates import boot_env, push_and_load
from moorage.runtime.vm_network import detach
from moorage.sandbox import GuestFileNotFound, Sandbox, SandboxError
from moorage.store.model import FORKED_FROM, SHARED_TEMPLATE

log = get_logger(__name__)

#: One change at a time per sandbox; an entry lives while a load holds or waits for it.
_locks: "weakref.WeakValueDictionary[str, asyncio.Lock]" = weakref.WeakValueDictionary()
#: How many agent turns run in each sandbox now (``in_turn``); an entry lives while one does.
_running: dict[str, int] = {}
#: How long a change waits for them; a turn still running then is cut by the restart (its connection ends).
DRAIN_S = 120.0


@contextlib.contextmanager
def in_turn(sandbox_id: str) -> Iterator[None]:
    """Around an agent turn running in the sandbox: a change of its packages waits for it to end."""
    _running[sandbox_id] = _running.get(sandbox_id, 0) + 1
    try:
        yield
    finally:
        left = _running.pop(sandbox_id) - 1
        if left:
            _running[sandbox_id] = left


def changing(sandbox_id: str) -> bool:
    """Whether a deployment is changing the sandbox now (its packages or environment; a restart of its processes): an
    app socket its restart cuts is told the agent was redeployed, not that it crashed."""
    lock = _locks.get(sandbox_id)
    return lock is not None and lock.locked()


async def drain(sandbox_id: str, timeout_s: float = DRAIN_S) -> int:
    """Wait until no agent turn runs in the sandbox, up to ``timeout_s``; returns how many still run."""
    deadline = time.monotonic() + timeout_s
    while _running.get(sandbox_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return _running.get(sandbox_id, 0)


async def installed(sandbox: Sandbox) -> str | None:
    """The digest of the requirements the sandbox's packages came from; None when it has no complete set."""
    try:
        return (await sandbox.read_file(deploy_packages.MARKER, max_bytes=256)).decode(errors="replace").strip()
    except GuestFileNotFound:
        return None


async def load(rt: Any, sandbox: Sandbox, deployment: Any, ts: Any,
               on_restart: Callable[[Any], Any] | None = None) -> bool:
    """``push_and_load`` of ``deployment`` into ``sandbox``, its packages and environment made the deployment's
    first. Returns whether the sandbox changed for them; ``on_restart`` then gets its channel (a new one after a
    restart) before the code is loaded, to set up the guest calls and network again."""
    archive = await asyncio.to_thread(rt.templates.archive, deployment)
    restarted = await onto_host_guest_code(rt, sandbox)
    restarted = await ensure(rt, sandbox, deployment, archive, ts) or restarted
    if restarted and on_restart is not None:
        res = on_restart(sandbox.channel)
        if inspect.isawaitable(res):
            await res
    await push_and_load(sandbox, deployment, archive)
    now = _loaded_at[sandbox.id] = time.monotonic()
    if len(_loaded_at) > 1024:  # only the last minute's matter: a host up for months does not keep one per sandbox
        for sid in [k for k, t in _loaded_at.items() if now - t > 60]:
            del _loaded_at[sid]
    return restarted


#: When ``load`` last loaded an agent's code into each sandbox (monotonic): an app its module starts may still be
#: binding its port for a while after (``app_guest.open_connection`` waits for it then).
_loaded_at: dict[str, float] = {}


def loaded_at(sandbox_id: str) -> float | None:
    return _loaded_at.get(sandbox_id)


def guest_code_behind(rt: Any, sandbox: Sandbox) -> bool:
    """Whether the sandbox's guest runs an older moorage's guest code that the driver can replace (a micro-VM made
    before an upgrade: ``sandbox/microvm_guest_code.py``). Cheap: read before a sandbox's first turn here."""
    return rt.driver.guest_code_behind(sandbox)


async def onto_host_guest_code(rt: Any, sandbox: Sandbox) -> bool:
    """Restart the sandbox onto this host's guest code when it runs an older one, after the turns running in it
    (``drain``); returns whether it restarted (the agent's code is to be loaded again)."""
    if not guest_code_behind(rt, sandbox):
        return False
    async with _locks.setdefault(sandbox.id, asyncio.Lock()):
        if _running.get(sandbox.id):
            await drain(sandbox.id)
        return await rt.driver.update_guest_code(sandbox)


async def ensure(rt: Any, sandbox: Sandbox, deployment: Any, archive: bytes, ts: Any) -> bool:
    """Make the sandbox's packages and environment those of ``deployment`` (see the module); returns whether it
    changed (restarted, or Debian packages changed in place): its channel's guest calls are to be set up again."""
    requirements = deploy_packages.requirements_of(unpack(archive))
    wanted, env = deploy_packages.digest(requirements), boot_env(deployment.manifest, requirements)
    apt = deploy_apt.packages_of(deployment.manifest)
    driver = rt.driver

    async def current() -> tuple[str | None, list[str] | None, bool, bool, bool, bool]:
        have, have_apt = await installed(sandbox), await deploy_apt.installed(sandbox)
        return (have, have_apt, (have or "") != wanted, (have_apt or []) != apt, driver.boot_env(sandbox) != env,
                await _old_app(sandbox, deployment))

    if not any((await current())[2:]):
        return False
    async with _locks.setdefault(sandbox.id, asyncio.Lock()):
        have, have_apt, packages, apt_changed, env_changed, old_app = await current()
        if not (packages or apt_changed or env_changed or old_app):  # another load did it meanwhile
            return False
        started = time.perf_counter()
        ref = await rt.templates.ensure(deployment)
        if (packages and have is None and wanted) or (apt_changed and have_apt is None):
            # No marker: packages from a template made before markers were written (or none). If the sandbox was
            # forked from, or binds, the deployment's own template, it has that template's packages already.
            rec = await asyncio.to_thread(ts.sandboxes.get, sandbox.id)
            own = (rec.meta.get(SHARED_TEMPLATE) or rec.meta.get(FORKED_FROM)) == ref.id
            packages = packages and not (have is None and own)
            apt_changed = apt_changed and not (have_apt is None and own)
            if not (packages or apt_changed or env_changed or old_app):
                return False
        shares = packages and driver.capabilities.shares_template_dirs
        restart_s, in_place = 0.0, 0
        if _running.get(sandbox.id):
            t, n = time.perf_counter(), _running[sandbox.id]
            left = await drain(sandbox.id)
            log.info("waited for the turns running in the sandbox", sandbox=sandbox.id, turns=n, still_running=left,
                     ms=round((time.perf_counter() - t) * 1000))

        def say(msg: str) -> None:
            log.info(msg, sandbox=sandbox.id)

        async def restart() -> list[str]:
            """Restart the sandbox's processes with the new environment: in place where the driver can (a micro-VM's
            guest forks a fresh supervisor; the kernel stays), else stop the sandbox, give it the new environment
            and bound directories, and start it; returns what it binds from the template when ``shares``."""
            nonlocal restart_s, env_changed, in_place
            t = time.perf_counter()
            try:
                if not shares and await driver.restart_in_place(sandbox, env if env_changed else None):
                    env_changed, in_place = False, in_place + 1
                    restart_s += time.perf_counter() - t
                    return []
            except SandboxError as e:  # stopped, disk kept: boots cold below
                log.warning("restart in place failed; booting cold", sandbox=sandbox.id, error=str(e))
            await sandbox.stop()
            if env_changed:
                await driver.set_boot_env(sandbox, env)
                env_changed = False
            bound = await driver.bind_shared(sandbox, ref) if shares else []
            await sandbox.start()
            restart_s += time.perf_counter() - t
            return bound

        async def install() -> str:
            """The deployment's packages into the sandbox's own files (none left if it has none)."""
            await sandbox.exec(["rm", "-rf", deploy_packages.SITE_DIR], timeout=300)
            if not requirements:
                return "removed"
            return await rt.templates.install_packages(sandbox, requirements, deployment.agent_id, say, template=ref)

        how, apt_how, restarts = "unchanged", "unchanged", 0
        if shares:
            await asyncio.to_thread(_name_shared_template, ts, sandbox.id, ref.id)
            how = "bound from the template" if requirements else "unbound"
            bound = await restart()
            restarts += 1
            if requirements and deploy_packages.SITE_DIR not in bound:
                how = await install()  # a process template made before templates shared their packages
                await restart()
                restarts += 1
            if apt_changed:  # not on this driver's sandboxes (apt needs root): says so
                apt_how = await rt.templates.update_apt(sandbox, apt, deployment.agent_id, say, ref)
        else:
            if env_changed:
                # First, so the installs below have the new environment's relay (downloads through the gateway)
                # and no process of the old one runs on; the packages' path is read again after them.
                await restart()
                restarts += 1
            if packages:
                how = await install()
            if apt_changed:
                apt_how = await rt.templates.update_apt(sandbox, apt, deployment.agent_id, say, ref)
            if packages and not restarts:
                # Started without them: modules of the old packages may be imported, C extensions cannot be
                # unloaded; a restart is the one way to drop them.
                await restart()
                restarts += 1
            elif packages:
                await sandbox.channel.call("packages.refresh", {}, timeout=30)
        if old_app and not restarts:  # its app's server is the old code's: only a restart frees its port
            await restart()
            restarts += 1
        # An install since the last restart served its downloads on this channel: that relay goes, and the caller
        # attaches the agent's own network again (``load``'s ``on_restart``).
        detach(sandbox.channel)
        ms = (time.perf_counter() - started) * 1000
        log.info("instance changed with its deployment", sandbox=sandbox.id, deployment=deployment.id,
                 template=ref.id, packages=how, apt=apt_how, restarts=restarts,
                 in_place=in_place, restart_ms=round(restart_s * 1000, 1), ms=round(ms, 1))
        return True


async def _old_app(sandbox: Sandbox, deployment: Any) -> bool:
    """Whether ``deployment`` declares an app and the sandbox's guest has another deployment's code loaded (whose
    module may have started the server that holds the app's port)."""
    if not deployment.manifest.get("ports"):
        return False
    try:
        info = await sandbox.channel.call("agent.info", {}, timeout=15)
    except Exception:  # noqa: BLE001 - a guest that cannot say has nothing loaded that a restart would free
        return False
    loaded = info.get("loaded") if isinstance(info, dict) else None
    return any(d != deployment.id for d in (loaded if isinstance(loaded, list) else []))


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
