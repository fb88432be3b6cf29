"""The ``process`` sandbox driver: the guest supervisor in bubblewrap namespaces on the host kernel.

Filesystem-only persistence: the host root is bound read-only, each sandbox owns a writable layer (/work, /tmp)
that is its snapshot; sleep stops every process, wake cold-starts the supervisor; fork and checkpoint copy the layer
(a template's shared directories, an agent's packages, are bound read-only into its forks instead:
process_templates.py).
Confinement: every namespace, no nested user namespaces, a seccomp filter (process_seccomp.py) and, on a host
running as root, an unprivileged host uid (``Config.sandbox_uid``) for everything in the sandbox.
"""


from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from moorage.config import Config
from moorage.errors import ConfigError, ConflictError, InvalidInput
from moorage.log import get_logger
from moorage.sandbox import process_limits as limits
from moorage.sandbox import process_net, process_seccomp, process_templates
from moorage.sandbox.base import (
    Capabilities,
    Sandbox,
    SandboxDriver,
    SandboxError,
    SandboxNotFound,
    SandboxSpec,
    SandboxState,
    SnapshotCorrupt,
    SnapshotIncompatible,
    TemplateRef,
    validate_id,
)
from moorage.sandbox.process_fs import copy_tree, write_json_durable
from moorage.sandbox.process_sandbox import (
    ETC_ALLOWLIST,
    GUEST_MOUNT,
    GUEST_UID,
    META_VERSION,
    SOCKET_NAME,
    STAGE,
    SUPERVISOR_PYTHON,
    ProcessSandbox,
)

__all__ = ["ProcessDriver", "ProcessSandbox"]

log = get_logger(__name__)


_guest_compiled: set[Path] = set()


def _compile_guest(guest: Path) -> None:
    """Byte-compile the guest package with the supervisor's own interpreter, once per host process. Sandboxes
    mount it read-only, where Python cannot cache bytecode, so every supervisor start (each wake and rollback)
    would compile the modules it imports again: ~15 ms of a ~110 ms start here."""
    if guest in _guest_compiled:
        return
    _guest_compiled.add(guest)
    try:
        subprocess.run([SUPERVISOR_PYTHON, "-I", "-m", "compileall", "-q", "-x", "__main__", str(guest)],
                       check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:  # a read-only install: slower starts, nothing else
        log.warning("could not byte-compile the guest package; sandbox starts compile it each time",
                    path=str(guest), error=str(e)[:200])


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError("bubblewrap (bwrap) is not installed", hint="run scripts/bootstrap.sh or apt-get install bubblewrap")
    return path


class ProcessDriver(SandboxDriver):
    """Sandboxes as bubblewrap-confined process trees. No memory snapshots: sleep keeps only the files."""

    name = "process"

    def __init__(self, root: Path, config: Config) -> None:
        super().__init__(root, config)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit_support = limits.detect()
        self.capabilities = Capabilities(
            keeps_processes_across_sleep=False,
            memory_snapshot=False,
            cow_fork=False,  # cp --reflink=auto: copy-on-write only where the filesystem supports reflinks
            network_isolated=True,
            own_kernel=False,
            enforced_limits=self.limit_support.enforced,
            survives_host_exit=False,  # bwrap --die-with-parent: the sandbox dies with the host process
            shares_template_dirs=True,
        )
        # Cgroup names must be unique per root directory on this host (two test roots may reuse sandbox ids).
        # Stable across host restarts (str hash() is salted per process), so a re-adopted sandbox finds its cgroup.
        self.instance_tag = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        self._open: dict[str, ProcessSandbox] = {}
        self._guest_dir = Path(__file__).resolve().parent.parent / "guest"
        #: The host uid sandbox processes run as: ``config.sandbox_uid`` when this host runs as root (bubblewrap
        #: would otherwise map the guest to host root), None when the host is already unprivileged.
        self.host_uid: int | None = config.sandbox_uid if os.geteuid() == 0 else None
        if self.host_uid == 0:
            raise ConfigError("sandbox_uid = 0 would run process sandboxes as host root",
                              hint="set sandbox_uid to an unprivileged uid no account uses (default 64000)")
        os.chmod(self.root, 0o700)
        process_seccomp.compile_filter()  # fail at start, not at the first wake, when libseccomp is missing
        # Beside serving, not before it (a host's start is its users' wait): a sandbox started meanwhile compiles
        # what it imports in its own memory, as without the cache; the cache's files appear whole (written aside,
        # then renamed).
        threading.Thread(target=_compile_guest, args=(self._guest_dir,), name="guest-compile", daemon=True).start()

    # --- bubblewrap command ----------------------------------------------------------------------------------

    def bwrap_argv(self, sb: ProcessSandbox, *, staged: bool = False, zygote_fd: int | None = None) -> list[str]:
        """The bubblewrap command. ``staged``: the sandbox's directories are bound under ``STAGE`` by a root launcher."""
        src = sb.sources()
        if staged:
            src = {name: Path(STAGE) / name for name in src}
        a = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--assert-userns-disabled",
             "--uid", str(GUEST_UID), "--gid", str(GUEST_UID), "--die-with-parent", "--new-session",
             "--hostname", "sandbox"]
        a += ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = Path("/") / top
            if p.is_symlink():
                a += ["--symlink", os.readlink(p), f"/{top}"]
            elif p.is_dir():
                a += ["--ro-bind", str(p), f"/{top}"]
        for name in ETC_ALLOWLIST:
            a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for name in ("passwd", "group", "hosts"):
            a += ["--ro-bind", str(src["etc"] / name), f"/etc/{name}"]
        if process_net.wanted(sb.spec.env):
            # A network agent's resolver asks the host's responder on the sandbox's own loopback (process_net); without
            # [agent.network] there is no resolv.conf (glibc then asks 127.0.0.1 too, where nothing answers).
            resolv = sb.dir / "etc" / "resolv.conf"
            if not resolv.exists():  # sandboxes made before this file was
                resolv.write_text(process_net.RESOLV_CONF)
            a += ["--ro-bind", str(src["etc"] / "resolv.conf"), "/etc/resolv.conf"]
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--bind", str(src["layer"] / "work"), "/work", "--bind", str(src["layer"] / "tmp"), "/tmp"]
        for name, target in sb.shared_targets():  # over the layer's (empty) mount points
            a += ["--ro-bind", str(src[name]), target]
        a += ["--bind", str(src["run"]), "/run/moorage"]
        a += ["--ro-bind", str(src["guest"]), GUEST_MOUNT]
        a += ["--chdir", "/work", "--clearenv"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "USER": "agent",
               "TMPDIR": "/tmp", "MOORAGE_WORKDIR": "/work", "MOORAGE_SANDBOX_ID": sb.id,
               # As the micro-VM image's pip.conf: the sandbox is the agent's own, so Debian's PEP 668 "externally
               # managed" refusal does not apply (pip installs into ~/.local, on the sandbox's disk).
               "PIP_BREAK_SYSTEM_PACKAGES": "1",
               # glibc reserves 64 MiB of address space per malloc arena, up to 8 per core: under RLIMIT_AS (the
               # memory bound where no cgroup is) a thread-per-connection server would stop at ~14 threads.
               "MALLOC_ARENA_MAX": "2", **dict(sb.spec.env)}
        for k, v in env.items():
            a += ["--setenv", k, v]
        a += ["--", SUPERVISOR_PYTHON, "-I", GUEST_MOUNT, "--listen", f"/run/moorage/{SOCKET_NAME}", "--workdir", "/work"]
        if zygote_fd is not None:
            a += ["--zygote-fd", str(zygote_fd)]
        return a

    # --- driver verbs ----------------------------------------------------------------------------------------

    def _new_dir(self, sandbox_id: str) -> Path:
        validate_id(sandbox_id)
        d = self.root / sandbox_id
        if d.exists():
            raise ConflictError(f"sandbox {sandbox_id} already exists under {self.root}", hint="open() it or pick a new id")
        return d

    def _init_dir(self, d: Path, spec: SandboxSpec) -> None:
        d.mkdir(mode=0o700, parents=True)
        (d / "run").mkdir(mode=0o700)
        (d / "etc").mkdir()
        (d / "etc" / "passwd").write_text(f"root:x:0:0:root:/root:/bin/sh\nagent:x:{GUEST_UID}:{GUEST_UID}:agent:/work:/bin/sh\n"
                                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (d / "etc" / "group").write_text(f"root:x:0:\nagent:x:{GUEST_UID}:\nnogroup:x:65534:\n")
        (d / "etc" / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
        (d / "etc" / "resolv.conf").write_text(process_net.RESOLV_CONF)

    def _meta(self, sandbox_id: str, spec: SandboxSpec, template: TemplateRef | None,
              shared: list[str]) -> dict[str, Any]:
        meta = {"version": META_VERSION, "driver": self.name, "id": sandbox_id, "state": SandboxState.CREATED.value,
                "spec": spec.to_json(), "created_at": time.time(), "template": template.id if template else None}
        if template is not None and shared:
            meta["shared"] = {"template": template.id, "dir": str(template.path), "paths": shared}
        return meta

    #: Fleet: fetches a published template to this host by id (``PublishedTemplates.fetch``), for a sandbox that
    #: arrives from another host binding a template this host lacks. Set by the host.
    template_source: Callable[[str], Any] | None = None

    def template_dir(self, template_id: str) -> Path:
        return self.root / ".templates" / validate_id(template_id, "template id")

    def _check_template(self, template: TemplateRef) -> Path:
        if template.driver != self.name:
            raise SnapshotIncompatible(f"template {template.id} was made by the {template.driver} driver",
                                       hint=f"make a template with the {self.name} driver")
        layer = Path(template.path) / "layer"
        if not layer.is_dir() or not (Path(template.path) / "template.json").exists():
            raise SnapshotCorrupt(f"template {template.id} at {template.path} is incomplete", hint="make the template again")
        if (Path(template.path) / process_templates.DELETED).exists():
            raise SandboxNotFound(f"template {template.id} was deleted", hint="make a new template")
        return layer

    async def create(self, sandbox_id: str, spec: SandboxSpec | None = None, template: TemplateRef | None = None) -> Sandbox:
        spec = spec or SandboxSpec()
        if spec.max_processes < 8 or spec.memory_mib < 32 or spec.disk_mib < 1:
            raise InvalidInput("sandbox limits too small", hint="max_processes >= 8, memory_mib >= 32, disk_mib >= 1")
        d = self._new_dir(sandbox_id)
        src = self._check_template(template) if template else None
        shared = process_templates.of_template(Path(template.path)) if template else []
        tmp = self.root / f".creating-{sandbox_id}-{uuid.uuid4().hex[:8]}"
        try:
            self._init_dir(tmp, spec)
            if src is not None and shared:
                # Its shared directories stay the template's (bound read-only at start): not copied.
                await process_templates.copy_layer(src, tmp / "layer", shared)
                process_templates.add_child(Path(template.path), sandbox_id)
            elif src is not None:
                await copy_tree(src, tmp / "layer")
            else:
                (tmp / "layer" / "work").mkdir(parents=True)
                (tmp / "layer" / "tmp").mkdir()
            os.chmod(tmp / "layer" / "tmp", 0o1777)
            meta = self._meta(sandbox_id, spec, template, shared)
            write_json_durable(tmp / "meta.json", meta)
            os.rename(tmp, d)  # a half-created sandbox never appears under its id
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if template is not None and shared:
                process_templates.drop_child(Path(template.path), sandbox_id)
            raise
        sb = ProcessSandbox(self, sandbox_id, meta)
        self._open[sandbox_id] = sb
        log.info("sandbox created", sandbox=sandbox_id, template=template.id if template else None)
        return sb

    async def open(self, sandbox_id: str) -> Sandbox:
        validate_id(sandbox_id)
        if sandbox_id in self._open:
            return self._open[sandbox_id]
        meta_path = self.root / sandbox_id / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {sandbox_id} under {self.root}") from None
        except ValueError as e:
            raise SnapshotCorrupt(f"metadata of sandbox {sandbox_id} is unreadable: {e}") from e
        if meta.get("driver") != self.name:
            raise SnapshotIncompatible(f"sandbox {sandbox_id} belongs to the {meta.get('driver')} driver",
                                       hint=f"open it with the {meta.get('driver')} driver")
        sb = ProcessSandbox(self, sandbox_id, meta)
        await sb._adopt()
        self._open[sandbox_id] = sb
        return sb

    async def fork(self, template: TemplateRef, ids: Sequence[str]) -> list[Sandbox]:
        for i in ids:
            self._new_dir(i)
        if len(set(ids)) != len(ids):
            raise InvalidInput("fork ids must be distinct")
        spec = SandboxSpec.from_json(json.loads((Path(template.path) / "template.json").read_text()).get("spec", {})) \
            if (Path(template.path) / "template.json").exists() else SandboxSpec()
        return [await self.create(i, spec, template) for i in ids]

    async def make_template(self, sandbox: Sandbox, template_id: str | None = None, *,
                            shared: Sequence[str] = (), standalone: bool = False) -> TemplateRef:
        """A copy of the sandbox's layer (standalone whatever ``standalone`` says: no template here chains onto the
        one its source was forked from). ``shared`` (paths under /work) are bound read-only into every fork
        instead of copied; a sandbox that binds shared directories itself passes them on (``process_templates``)."""
        if not isinstance(sandbox, ProcessSandbox) or sandbox.driver is not self:
            raise SnapshotIncompatible("make_template needs a sandbox of this process driver")
        tid = validate_id(template_id or f"tpl-{uuid.uuid4().hex[:12]}", "template id")
        inherited = (sandbox.meta.get("shared") or {}).get("paths") or []
        rels = process_templates.layer_paths([*shared, *map(process_templates.sandbox_path, inherited)])
        dest = self.root / ".templates" / tid
        if dest.exists():
            raise ConflictError(f"template {tid} already exists", hint="pick another template id")
        async with sandbox._lock:
            if sandbox.state is SandboxState.RUNNING:
                await sandbox.channel.call("sys.sync", timeout=30)
            tmp = self.root / ".templates" / f".{tid}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                await copy_tree(sandbox.layer, tmp / "layer")
                for rel in rels:  # real directories only: a link there could name any host path
                    if not process_templates.real_dir(tmp / "layer", rel, parents_only=rel in inherited):
                        raise InvalidInput(f"shared path {process_templates.sandbox_path(rel)} is not a directory "
                                           f"in sandbox {sandbox.id}", hint="no symbolic link on its way either")
                if inherited:  # its mount points are empty here: the files are its own template's
                    origin = process_templates.template_of(sandbox.meta, self.template_dir)
                    for rel in inherited:
                        await asyncio.to_thread(process_templates.link_tree, origin / "layer" / rel, tmp / "layer" / rel)
                created = time.time()
                record: dict[str, Any] = {"id": tid, "driver": self.name, "source": sandbox.id, "created_at": created,
                                          "spec": sandbox.spec.to_json()}
                if rels:
                    record["shared"] = rels
                write_json_durable(tmp / "template.json", record)
                os.rename(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return TemplateRef(tid, self.name, dest, sandbox.id, created, includes_memory=False)

    def boot_env(self, sandbox: Sandbox) -> dict[str, str]:
        assert isinstance(sandbox, ProcessSandbox)
        return dict(sandbox.spec.env)

    async def set_boot_env(self, sandbox: Sandbox, env: Mapping[str, str]) -> None:
        if not isinstance(sandbox, ProcessSandbox) or sandbox.driver is not self:
            raise SnapshotIncompatible("set_boot_env needs a sandbox of this process driver")
        async with sandbox._lock:
            sandbox._require(SandboxState.CREATED, SandboxState.STOPPED, SandboxState.SLEEPING, verb="change")
            sandbox.spec = dataclasses.replace(sandbox.spec, env=dict(env))
            sandbox._save(spec=sandbox.spec.to_json())

    async def bind_shared(self, sandbox: Sandbox, template: TemplateRef) -> list[str]:
        if not isinstance(sandbox, ProcessSandbox) or sandbox.driver is not self:
            raise SnapshotIncompatible("bind_shared needs a sandbox of this process driver")
        tdir = Path(template.path)
        self._check_template(template)
        async with sandbox._lock:
            sandbox._require(SandboxState.CREATED, SandboxState.STOPPED, SandboxState.SLEEPING, verb="rebind")
            before = process_templates.template_of(sandbox.meta, self.template_dir) if sandbox.meta.get("shared") \
                else None
            paths = await asyncio.to_thread(process_templates.rebind, sandbox.meta, sandbox.layer, tdir, template.id,
                                            sandbox.id)
            sandbox._save()
            if before is not None and before != tdir:
                await asyncio.to_thread(process_templates.drop_child, before, sandbox.id)
        log.info("sandbox binds another template's shared directories", sandbox=sandbox.id, template=template.id)
        return [process_templates.sandbox_path(p) for p in paths]

    async def delete_template(self, template: TemplateRef) -> None:
        """Gone now, or (a template whose shared directories forks on this host bind) marked deleted and gone
        with the last of them."""
        if (Path(template.path) / process_templates.DELETED).exists():
            process_templates.collect(Path(template.path))  # again: its last fork may have gone meanwhile
            return
        self._check_template(template)
        process_templates.delete(Path(template.path))

    async def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / "meta.json").exists())

    #: Parts of a sandbox directory that belong to this host only: the channel socket and the supervisor's log.
    _HOST_LOCAL = ("run", "supervisor.log")

    def adopt_fetched(self, sandbox_id: str) -> None:
        """A copy shipped while awake records the other host's process: here nothing of it runs (it boots). One
        that binds a template's shared directories binds this host's copy of it. Blocking."""
        path = self.root / validate_id(sandbox_id) / "meta.json"
        meta = json.loads(path.read_text())
        changed = False
        if meta.get("state") == SandboxState.RUNNING.value or meta.get("pid") is not None:
            meta.update(state=SandboxState.STOPPED.value, pid=None, pid_starttime=None)
            changed = True
        shared = meta.get("shared")
        if shared:  # the template it binds, this host's copy (fetched when missing)
            tdir = self.template_dir(shared["template"])
            why = "no template source is set"
            if not (tdir / "template.json").exists() and self.template_source is not None:
                try:
                    self.template_source(shared["template"])
                except Exception as e:  # noqa: BLE001 - not published, or the object store failed: said below
                    why = str(e)
            if not (tdir / "template.json").exists():
                raise SnapshotCorrupt(f"sandbox {sandbox_id} binds template {shared['template']}'s shared files, "
                                      f"which is not on this host and could not be fetched: {why}",
                                      hint="publish the template (fleet hosts publish deployment templates)")
            process_templates.add_child(tdir, sandbox_id)
            shared["dir"] = str(tdir)
            changed = True
        if changed:
            write_json_durable(path, meta)

    @classmethod
    def portable(cls, rel: str) -> bool:
        """Whether ``rel`` (a path in a sandbox's directory) is part of its sleeping state on any host: the
        layer (its files), etc, meta.json and checkpoints travel; sockets, pids and logs stay."""
        return rel.split("/", 1)[0] not in cls._HOST_LOCAL and not rel.startswith(".")

    async def close(self) -> None:
        for sb in list(self._open.values()):
            if sb._watchdog is not None:
                sb._watchdog.cancel()
            sb._drop_dns()  # its address stays free for the host that adopts the sandbox next
            if sb._channel is not None:
                await sb._channel.close()
                sb._channel = None
        self._open.clear()
