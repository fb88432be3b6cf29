"""The micro-VM sandbox driver: one QEMU ``-M microvm`` guest per sandbox, asleep as a snapshot when idle.

Its parts, a file each: one VM's lifecycle (``microvm_sandbox``; its QEMU process in ``microvm_process``, its wake
from a snapshot in ``microvm_wake``), the files of its snapshots and checkpoints
(``microvm_snapshots``, RAM in ``microvm_ram`` and ``microvm_ram_chain``), templates and forks
(``microvm_templates``), what travels between a fleet's hosts (``microvm_fleet``), QEMU's command line and process
(``microvm_qemu``), its network (``microvm_net``) and its unprivileged user (``microvm_user``). The design and its
reasons: docs/decisions/0002-microvm-snapshots.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from moorage.config import Config
from moorage.errors import ConflictError, InvalidInput
from moorage.log import get_logger
from moorage.sandbox import (microvm_fleet, microvm_guest_code, microvm_memfd, microvm_moved, microvm_net,
                             microvm_templates)
from moorage.sandbox.accel import choose_accel, probe_kvm
from moorage.sandbox.base import (
    Capabilities,
    Sandbox,
    SandboxDriver,
    SandboxNotFound,
    SandboxSpec,
    SandboxState,
    SandboxStateError,
    SnapshotIncompatible,
    TemplateRef,
    validate_id,
)
from moorage.sandbox.image import GuestImage, ImageBuilder
from moorage.sandbox.microvm_files import qemu_img, write_json
from moorage.sandbox.microvm_qemu import VMConfig, kernel_cmdline, kill_pid, pid_is_ours, qemu_version
from moorage.sandbox.microvm_sandbox import BootError, MicroVMSandbox

__all__ = ["BootError", "MicroVMDriver", "MicroVMSandbox"]

log = get_logger(__name__)


class MicroVMDriver(SandboxDriver):
    """Sandboxes as QEMU micro-VMs under ``root`` (one directory each; templates under ``root/.templates``)."""

    name = "microvm"
    capabilities = Capabilities(
        keeps_processes_across_sleep=True,
        memory_snapshot=True,
        cow_fork=True,
        network_isolated=True,
        own_kernel=True,
        enforced_limits=frozenset({"memory", "disk"}),
    )

    def __init__(self, root: Path, config: Config, *, images_dir: Path | None = None, drop_caches_on_sleep: bool = False) -> None:
        super().__init__(root, config)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # RAM files, disks and snapshots are this host's alone
        self.root = self.root.resolve()  # QEMU command lines carry absolute paths; orphans are found by them
        self.images_dir = Path(images_dir) if images_dir else config.images_dir
        self.drop_caches_on_sleep = drop_caches_on_sleep
        self._open: dict[str, MicroVMSandbox] = {}
        self._accel: str | None = None

    @property
    def accel(self) -> str:
        if self._accel is None:
            if self.config.accel == "auto":
                # Probe with this driver's own image kernel (no second download); cached per host boot with it.
                img = self.image()
                self._accel = "kvm" if probe_kvm(self.config, kernel=img.kernel, initrd=img.initrd,
                                                 images_dir=self.images_dir).usable else "tcg"
            else:
                self._accel = choose_accel(self.config)
        return self._accel

    def image(self) -> GuestImage:
        """The guest image for this configuration, built on first use (cached afterwards). While one is built, the
        KVM probe (``accel``) runs beside it from the moment its kernel is there: on a host whose KVM hangs a guest
        it waits out its timeout then, not after the build."""
        return ImageBuilder(self.images_dir).build(on_kernel=self._probe_early if self.config.accel == "auto" else None)

    def _probe_early(self, kdir: Path) -> None:
        if self._accel is None and os.path.exists("/dev/kvm"):
            threading.Thread(target=probe_kvm, args=(self.config,), name="kvm-probe", daemon=True,
                             kwargs={"kernel": kdir / "vmlinuz", "initrd": kdir / "initrd.img",
                                     "images_dir": self.images_dir}).start()

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / validate_id(sandbox_id)

    async def _shape(self, spec: SandboxSpec) -> tuple[GuestImage, VMConfig, int]:
        """What a sandbox created from ``spec`` boots: its image, its machine and its disk's size in MiB."""
        img = await asyncio.to_thread(self.image)
        await asyncio.to_thread(lambda: self.accel)
        if spec.memory_mib < 128:
            raise InvalidInput(f"memory_mib={spec.memory_mib} is too small for the guest", hint="use at least 128")
        if spec.disk_mib < 1:
            raise InvalidInput(f"disk_mib={spec.disk_mib} leaves the agent no disk space", hint="use disk_mib >= 1")
        # Limits and environment reach the guest's init on the kernel command line (there is no other way in
        # before the channel is up, and it is part of the snapshot's layout, which forks share anyway).
        extra = f" moorage.nproc={spec.max_processes} moorage.fsize={spec.max_file_mib << 20} moorage.growfs"
        extra += _env_arg(spec.env)
        # A network agent's VM gets a NIC where this host can make a tap (else its relay is its network).
        nic = await asyncio.to_thread(microvm_net.wanted, spec.env)
        vm = VMConfig(memory_mib=spec.memory_mib, vcpus=spec.vcpus, accel=self.accel,
                      kernel_cmdline=kernel_cmdline(img.cmdline + extra, self.accel), nic=nic)
        # The agent's disk: a copy-on-write overlay on the image's root filesystem (shrunk to its contents),
        # disk_mib larger; the guest grows the filesystem to fill it at boot. So disk_mib is the agent's own space,
        # and a guest can never make its disk hold more than image + disk_mib (+ qcow2 metadata) on the host.
        return img, vm, img.disk_mib + spec.disk_mib

    async def boot_key(self, spec: SandboxSpec) -> str | None:
        """The image, the machine and kernel command line, the disk's size, the spec and the QEMU build."""
        img, vm, disk_mib = await self._shape(spec)
        shape = {"image": img.id, "vm": vm.__dict__, "disk_mib": disk_mib, "spec": spec.to_json(),
                 "qemu": await asyncio.to_thread(qemu_version)}
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()

    async def create(self, sandbox_id: str, spec: SandboxSpec | None = None, template: TemplateRef | None = None) -> MicroVMSandbox:
        if template is not None:
            return (await self.fork(template, [sandbox_id]))[0]
        spec = spec or SandboxSpec()
        d = self._dir(sandbox_id)
        if d.exists():
            raise ConflictError(f"sandbox {sandbox_id} already exists", hint="open() it or destroy() it first")
        img, vm, disk_mib = await self._shape(spec)
        d.mkdir(parents=True)
        await qemu_img("create", "-q", "-f", "qcow2", "-b", str(img.rootfs), "-F", "raw", str(d / "disk.qcow2"),
                        f"{disk_mib}M", sandbox_dir=d)
        meta = {
            "id": sandbox_id,
            "driver": self.name,
            "spec": spec.to_json(),
            "image_id": img.id,
            "image_dir": str(img.dir),
            "vm": vm.__dict__,
            "ram_mode": "shared",
            "template_dir": None,
            "state": SandboxState.CREATED.value,
            "pid": None,
            "snapshot": None,
            "fresh_fork": False,
            "created_at": time.time(),
        }
        write_json(d / "meta.json", meta)
        sb = MicroVMSandbox(self, sandbox_id, meta)
        self._open[sandbox_id] = sb
        return sb

    async def open(self, sandbox_id: str) -> MicroVMSandbox:
        if sandbox_id in self._open:
            return self._open[sandbox_id]
        d = self._dir(sandbox_id)
        try:
            meta = json.loads((d / "meta.json").read_text())
        except FileNotFoundError as e:
            raise SandboxNotFound(f"no sandbox {sandbox_id} under {self.root}") from e
        meta = await asyncio.to_thread(microvm_moved.sandbox_here, self, d, meta)  # a restored data directory's
        sb = MicroVMSandbox(self, sandbox_id, meta)
        if meta["state"] == SandboxState.RUNNING.value:
            if not await sb._reattach():
                # QEMU died with the host: no consistent memory image exists, the disk does.
                sb._set_state(SandboxState.STOPPED, pid=None, snapshot=None)
        else:
            # A QEMU left over from a crash in the middle of a sleep (its snapshot may be incomplete), or of a wake
            # or boot before its pid was recorded with the state (``qemu.pid`` names it from its start): that one
            # runs the guest on this sandbox's disk and memory file, and a wake now would start a second on them.
            for pid in {meta.get("pid"), _pid_in(d / "qemu.pid")} - {None}:
                if pid_is_ours(pid, str(sb.run_dir)):
                    log.warning("killing a QEMU left over from a host that died", sandbox=sandbox_id, pid=pid)
                    kill_pid(pid)
            (d / "qemu.pid").unlink(missing_ok=True)
            if meta.get("pid"):
                sb._meta["pid"] = None
                sb._save_meta()
        await sb._sweep_unfinished()  # what a crash in a sleep or checkpoint left half made
        self._open[sandbox_id] = sb
        return sb

    async def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "meta.json").exists())

    # --- the fleet: what travels between hosts, and making a fetched copy this host's (microvm_fleet) ----------

    #: Set by a fleet member: called with a template id when a fetched sandbox's template is not on this host;
    #: it brings the template into ``template_dir(id)`` (blocking) or raises.
    template_source: Callable[[str], Any] | None = None

    @classmethod
    def portable(cls, rel: str) -> bool:
        """Whether ``rel`` (a path in a sandbox's directory) travels with its snapshot to another host."""
        return rel.split("/", 1)[0] in microvm_fleet.PORTABLE

    @classmethod
    def template_portable(cls, rel: str) -> bool:
        """Whether ``rel`` (a path in a template's directory) travels when the template is published."""
        return rel.split("/", 1)[0] in microvm_fleet.TEMPLATE_PORTABLE

    def template_dir(self, template_id: str) -> Path:
        return self.root / microvm_templates.TEMPLATES / validate_id(template_id, "template id")

    @staticmethod
    def template_image_id(tdir: Path) -> str | None:
        """The guest image a template's disk and memory were made on (its disk is an overlay on that rootfs)."""
        return json.loads((Path(tdir) / "template.json").read_text()).get("image_id")

    @staticmethod
    def template_image_dir(tdir: Path) -> Path:
        return Path(json.loads((Path(tdir) / "template.json").read_text())["image_dir"])

    def template_outdated(self, template: TemplateRef) -> str | None:
        """Why ``template`` can no longer be forked here (its memory was saved by another QEMU build, the QEMU
        package upgraded since, or with another device layout, a moorage upgrade), or None. The runtime then builds
        the deployment's template again."""
        try:
            tmeta = json.loads((Path(template.path) / "template.json").read_text())
            made, layout = tmeta["snapshot"].get("qemu"), VMConfig(**tmeta["vm"]).layout_id()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if made != qemu_version():
            return f"made with {made}, this host runs {qemu_version()}"
        return None if tmeta["snapshot"].get("layout") == layout else "saved with another device layout"

    def adopt_template(self, staging: Path, final: Path, image: GuestImage) -> None:
        """A template fetched into ``staging`` made this host's (``microvm_fleet.adopt_template``). Blocking."""
        microvm_fleet.adopt_template(staging, final, image)

    def adopt_fetched(self, sandbox_id: str) -> None:
        """A sandbox fetched from another host made this host's (``microvm_fleet.adopt_fetched``). Blocking."""
        microvm_fleet.adopt_fetched(self, self._dir(sandbox_id), sandbox_id)
        self._open.pop(sandbox_id, None)

    # --- templates and forks (microvm_templates) --------------------------------------------------------------

    async def make_template(self, sandbox: Sandbox, template_id: str | None = None, *,
                            shared: Sequence[str] = (), standalone: bool = False) -> TemplateRef:
        # ``shared`` needs nothing here: every fork's disk is already a copy-on-write overlay on the template's.
        # A fork's template has its RAM whole but its disk on its source template's, unless ``standalone``.
        if not isinstance(sandbox, MicroVMSandbox):
            raise InvalidInput("make_template needs a sandbox of the microvm driver")
        tid = validate_id(template_id or f"tpl-{sandbox.id}-{int(time.time())}", "template id")
        return await microvm_templates.make(self, sandbox, tid, standalone=standalone)

    def boot_env(self, sandbox: Sandbox) -> dict[str, str]:
        assert isinstance(sandbox, MicroVMSandbox)
        return dict(sandbox._meta["spec"].get("env") or {})

    async def set_boot_env(self, sandbox: Sandbox, env: Mapping[str, str]) -> None:
        """The environment is on the kernel command line, and a network agent's on a NIC: both change for the next
        (cold) boot; a sleeping VM's snapshot was made with the old ones, so it boots cold either way."""
        if not isinstance(sandbox, MicroVMSandbox) or sandbox._driver is not self:
            raise SnapshotIncompatible("set_boot_env needs a sandbox of this micro-VM driver")
        arg = _env_arg(env)
        async with sandbox._lock:
            if sandbox.state is SandboxState.RUNNING:
                raise SandboxStateError(f"cannot change sandbox {sandbox.id}'s environment: it is running",
                                        hint="stop it first")
            _record_env(sandbox, env, arg, await asyncio.to_thread(microvm_net.wanted, env))

    def guest_code_behind(self, sandbox: Sandbox) -> bool:
        return isinstance(sandbox, MicroVMSandbox) and microvm_guest_code.behind(sandbox, self.images_dir)

    async def update_guest_code(self, sandbox: Sandbox) -> bool:
        if not isinstance(sandbox, MicroVMSandbox) or sandbox._driver is not self:
            return False
        return await microvm_guest_code.bring_up_to_date(self, sandbox)

    async def restart_in_place(self, sandbox: Sandbox, env: Mapping[str, str] | None = None, *,
                               this_run_only: bool = False) -> bool:
        """Every process of the guest but its init is killed and a fresh supervisor started with the new environment
        (``sys.restart``: forked from the guest's holder, guest/restart.py); the host connects to the new one. The
        kernel, its page cache and the VM's devices stay: about 0.25 s under TCG (1.4 s when what an interpreter
        reads as it starts changed, e.g. ``LANG``) where a cold boot takes ten. Not for a change that adds or drops the NIC (a device
        comes only with a boot), nor a guest image from before ``sys.restart``. A guest that does not come back is
        stopped (disk kept): the caller's start boots it cold. ``this_run_only``: ``env`` is for the processes started
        now, not recorded as the sandbox's (its next start gets the one it had)."""
        if not isinstance(sandbox, MicroVMSandbox) or sandbox._driver is not self:
            raise SnapshotIncompatible("restart_in_place needs a sandbox of this micro-VM driver")
        arg = _env_arg(env) if env is not None else ""
        if env is not None and await asyncio.to_thread(microvm_net.wanted, env) != sandbox._vm_config().nic:
            return False
        async with sandbox._lock:
            if sandbox.state is not SandboxState.RUNNING:
                raise SandboxStateError(f"cannot restart sandbox {sandbox.id}'s processes: it is {sandbox.state.value}",
                                        hint="start it instead")
            before = await sandbox.channel.call("ping", {}, timeout=30)
            if "sys.restart" not in (before.get("methods") or []):
                return False
            old = dict(sandbox._meta["spec"].get("env") or {})
            params = {} if env is None else {"env": dict(env), "unset": sorted(set(old) - set(env))}
            started = time.monotonic()
            try:
                await sandbox.channel.call("sys.restart", params, timeout=30)
                await sandbox._reconnect(lambda reply: reply.get("boot_id") != before.get("boot_id"))
            except BaseException:
                await sandbox._teardown()
                sandbox._set_state(SandboxState.STOPPED, snapshot=None)
                raise
            if env is not None and not this_run_only:
                _record_env(sandbox, env, arg, sandbox._vm_config().nic)
        log.info("processes restarted in place", sandbox=sandbox.id, ms=round((time.monotonic() - started) * 1000))
        return True

    def cool_template(self, template: TemplateRef) -> None:
        """The sealed copy of the template's RAM goes (running forks keep theirs mapped)."""
        microvm_memfd.release(Path(template.path) / "ram")

    def warm_template(self, template: TemplateRef) -> bool:
        """The template RAM's sealed in-memory copy that forks map, made now if the host can spare the memory."""
        return microvm_templates.warm(Path(template.path))

    async def delete_template(self, template: TemplateRef) -> None:
        """No new forks from it; its files go when the last fork that maps its RAM and disk is destroyed."""
        microvm_templates.delete(template)

    async def fork(self, template: TemplateRef, ids: Sequence[str]) -> list[MicroVMSandbox]:
        await asyncio.to_thread(microvm_moved.template_here, self, Path(template.path))
        tmeta = microvm_templates.forkable(self, template, ids)
        metas = await asyncio.gather(*(microvm_templates.fork_one(self, Path(template.path), tmeta, sid) for sid in ids))
        forks = [MicroVMSandbox(self, sid, meta) for sid, meta in zip(ids, metas)]
        self._open.update((sb.id, sb) for sb in forks)
        return forks

    # --- hygiene --------------------------------------------------------------------------------------------

    def find_orphans(self) -> list[int]:
        """QEMU processes started for a sandbox under ``root`` that no sandbox owns any more: its directory is
        gone, or its metadata says it is not running, or names another process (a crash between steps)."""
        marker = f"file:{self.root.resolve()}/"
        orphans = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # ``-serial file:<pipe>``, or the label of the console's descriptor (``-add-fd ...,opaque=file:<pipe>``)
            serial = next((s for s in (a.decode(errors="replace").split(",opaque=", 1)[-1] for a in args)
                           if s.startswith(marker)), None)
            if serial is None or not pid_is_ours(int(proc.name), marker):
                continue
            sandbox_dir = Path(serial.removeprefix("file:")).parent
            try:
                meta = json.loads((sandbox_dir / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            if meta.get("state") != SandboxState.RUNNING.value or meta.get("pid") != int(proc.name):
                orphans.append(int(proc.name))
        return orphans

    def kill_orphans(self) -> list[int]:
        pids = self.find_orphans()
        for pid in pids:
            kill_pid(pid)
        return pids

    async def close(self) -> None:
        for sb in list(self._open.values()):
            await sb._lock.caught_up()  # a checkpoint still being written is finished first
            await sb._detach()
        self._open.clear()
        microvm_memfd.release_under(self.root)  # running QEMUs keep their own references


def _record_env(sandbox: MicroVMSandbox, env: Mapping[str, str], arg: str, nic: bool) -> None:
    """The sandbox's spec has ``env``, and its next boot's kernel command line ``arg`` (``_env_arg``) and ``nic``."""
    vm = dict(sandbox._meta["vm"])
    kept = [t for t in str(vm["kernel_cmdline"]).split(" ") if not t.startswith("moorage.env=")]
    vm["kernel_cmdline"] = " ".join(kept) + arg
    vm["nic"] = nic
    sandbox._meta["spec"] = {**sandbox._meta["spec"], "env": dict(env)}
    sandbox._meta["vm"] = vm
    sandbox._save_meta()


def _env_arg(env: Mapping[str, str]) -> str:
    """The kernel command line's ``moorage.env=`` argument for ``env`` (JSON, base64url; the guest's init reads it)."""
    if not env:
        return ""
    arg = " moorage.env=" + base64.urlsafe_b64encode(json.dumps(dict(env)).encode()).decode()
    if len(arg) > 1024:
        raise InvalidInput("sandbox environment too large for a micro-VM (1 KiB encoded)",
                           hint="pass large settings as a file instead")
    return arg


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
