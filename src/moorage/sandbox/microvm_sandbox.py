"""One micro-VM sandbox: a QEMU ``-M microvm`` guest, asleep as a snapshot when idle.

Sleep saves device state (``xen-save-devices-state``) next to guest RAM that already lives in a file; wake starts
the same command line with ``-incoming defer`` and loads it. A fork maps its template's RAM privately and saves
only the pages it changed. Checkpoints add the disk's qcow2 internal snapshot and the pages changed since the last
one (``microvm_ram_chain``). The design and its reasons: docs/decisions/0002-microvm-snapshots.md. Its parts:
the QEMU process and guest channel (``microvm_process``), the wake from a snapshot (``microvm_wake``), snapshots
of the running guest and checkpoints (``microvm_checkpointing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from moorage.log import get_logger
from moorage.sandbox import microvm_net, microvm_templates, microvm_user
from moorage.sandbox.base import (
    ChannelError,
    Sandbox,
    SandboxError,
    SandboxState,
    SandboxStateError,
    SandboxStats,
    SnapshotInfo,
)
from moorage.sandbox.channel import Channel
from moorage.sandbox.image import GuestImage
from moorage.sandbox.microvm_checkpointing import Checkpointing
from moorage.sandbox.microvm_diskfull import DiskFullPause, paused_error
from moorage.sandbox.microvm_guest_port import GuestPortWatch
from moorage.sandbox.microvm_files import allocated, write_json
from moorage.sandbox.microvm_process import COLD_BOOT_TIMEOUT_S, QemuProcess
from moorage.sandbox.microvm_process import BootError
from moorage.sandbox.microvm_qemu import VMConfig, VMPaths, build_argv, pid_is_ours, run_dir_for
from moorage.sandbox.microvm_wake import Waking
from moorage.sandbox.qmp import QMPClient, QMPError

if TYPE_CHECKING:
    from moorage.sandbox.microvm import MicroVMDriver

__all__ = ["BootError", "MicroVMSandbox"]  # BootError lives in microvm_process; named here for microvm.py

log = get_logger(__name__)


class _VerbLock:
    """A sandbox's lock: one lifecycle verb at a time, and none before the files of a checkpoint written behind
    (``checkpoint(durable=False)``) are on disk."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        #: The task writing the last checkpoint's files while the guest runs on (it logs its own failure).
        self.behind: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        try:
            await self.caught_up()
        except BaseException:
            self._lock.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        """Whether a verb holds it now."""
        return self._lock.locked()

    async def caught_up(self) -> None:
        task = self.behind
        if task is not None:
            await asyncio.wait([task])  # a cancelled waiter leaves the write running
            if self.behind is task:
                self.behind = None


class MicroVMSandbox(GuestPortWatch, DiskFullPause, Checkpointing, Waking, QemuProcess, Sandbox):
    """One micro-VM. All lifecycle verbs are serialised by a per-sandbox lock; state is persisted in meta.json."""

    def __init__(self, driver: "MicroVMDriver", sandbox_id: str, meta: dict[str, Any]) -> None:
        self.id = sandbox_id
        self._driver = driver
        self._meta = meta
        self.dir = driver.root / sandbox_id
        self.run_dir = run_dir_for(self.dir)
        self._lock = _VerbLock()
        self._proc: subprocess.Popen[bytes] | None = None
        #: A killed QEMU child not reaped yet (it must be gone before the next launch: it holds the disk lock).
        self._qmp: QMPClient | None = None
        self._channel: Channel | None = None
        #: Why the last wake fell back to a cold boot (SnapshotCorrupt / SnapshotIncompatible), or None.
        self.last_wake_fallback: SandboxError | None = None
        #: How the last wake went: "snapshot" (memory restored), "cold" (booted from disk) or None.
        self.last_wake_mode: str | None = None
        #: Milliseconds per step of the last wake from a snapshot (validate, QEMU start, device state, first reply).
        self.last_wake_phases: dict[str, int] = {}
        self.last_snapshot_phases: dict[str, int] = {}  # ms per step of the last sleep or checkpoint
        #: A QEMU is up with this sleeping sandbox's snapshot loaded and the guest paused (``prepare``): the next
        #: wake only resumes it. In this process's memory only: a restarted host kills such a QEMU (``open``).
        self._prepared = False
        #: This launch's namespace and tap when the layout has a NIC (a new one every launch: wake, fork, boot).
        self._net: microvm_net.VMNetwork | None = None
        #: The clock set again after a wake, once the guest is warm (held: asyncio keeps weak references).
        self._clock_again: asyncio.Task[None] | None = None
        #: QEMU paused the guest: a write to its disk found the host's disk full (``microvm_diskfull``).
        self._disk_full = False
        self._resumer: asyncio.Task[None] | None = None

    # --- state ----------------------------------------------------------------------------------------------

    @property
    def state(self) -> SandboxState:
        return SandboxState(self._meta["state"])

    @property
    def channel(self) -> Channel:
        if self.state is not SandboxState.RUNNING or self._channel is None or self._channel.closed:
            raise SandboxStateError(f"sandbox {self.id} is {self.state.value}, its channel is not connected", hint="call wake() first")
        if self._disk_full:
            raise paused_error(self.id)
        return self._channel

    @property
    def pid(self) -> int | None:
        return self._meta.get("pid")

    @property
    def ram_mode(self) -> str:
        return str(self._meta["ram_mode"])

    def _save_meta(self) -> None:
        write_json(self.dir / "meta.json", self._meta)

    def _set_state(self, state: SandboxState, **fields: Any) -> None:
        if state is not SandboxState.SLEEPING or fields.get("snapshot"):
            self._meta.pop("slept_stopped", None)  # asleep as its disk no more (``_sleep_stopped``)
        self._meta["state"] = state.value
        self._meta.update(fields)
        self._save_meta()

    # --- paths and command line -----------------------------------------------------------------------------

    @property
    def _image(self) -> GuestImage:
        return GuestImage.load(Path(self._meta["image_dir"]))

    def _vm_config(self) -> VMConfig:
        return VMConfig(**self._meta["vm"])

    def _ram_path(self) -> Path:
        if self.ram_mode == "delta":
            return Path(self._meta["template_dir"]) / "ram"
        return self.dir / "ram"

    def _paths(self) -> VMPaths:
        img = self._image
        return VMPaths(
            kernel=img.kernel,
            initrd=img.initrd,
            disk=self.dir / "disk.qcow2",
            ram=self._ram_path(),
            console_log=self.dir / "console.log",
            qmp_sock=self.run_dir / "qmp.sock",
            chan_sock=self.run_dir / "chan.sock",
        )

    def _argv(self, incoming: bool, paused: bool = False) -> list[str]:
        argv = build_argv(self.id, self._vm_config(), self._paths(), ram_shared=self.ram_mode == "shared", incoming=incoming,
                          tap_fd=self._net.tap_fd if self._net is not None else None)
        # -S: the guest does not run once the incoming state is loaded; a prepared sandbox waits for `cont`.
        return argv + ["-S"] if paused else argv

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            if self.state is SandboxState.RUNNING:
                return
            if self.state is SandboxState.DESTROYED:
                raise SandboxStateError(f"sandbox {self.id} is destroyed")
            await self._cold_boot()

    async def _cold_boot(self) -> None:
        await self._teardown()
        if self.ram_mode == "delta":
            # Without its snapshot a fork no longer relates to the template's memory: it gets RAM of its own.
            # (Its disk is still an overlay on the template's, so it stays registered as the template's child.)
            self._meta["ram_mode"] = "shared"
        ram_file = self.dir / "ram"
        ram_file.unlink(missing_ok=True)
        with open(ram_file, "wb") as f:
            f.truncate(self._vm_config().memory_mib << 20)
        shutil.rmtree(self.dir / "snapshot", ignore_errors=True)
        started = time.monotonic()
        try:
            await self._launch(incoming=False)
            await self._connect_channel(COLD_BOOT_TIMEOUT_S)
        except BaseException:
            await self._teardown()
            self._set_state(SandboxState.STOPPED, snapshot=None)
            raise
        self.last_wake_mode = "cold"
        self._set_state(SandboxState.RUNNING, snapshot=None, fresh_fork=False)
        log.info("cold boot", sandbox=self.id, ms=round((time.monotonic() - started) * 1000))

    async def sleep(self) -> SnapshotInfo:
        async with self._lock:
            if self.state is SandboxState.STOPPED:
                return await self._sleep_stopped()
            if self.state is SandboxState.RUNNING and self._qemu_gone():
                # Its QEMU died by itself (killed from outside, crashed): the guest's memory went with it, as with
                # a stopped guest. Its sleep failed ("QMP not connected") and every idle sleep after it.
                log.warning("the micro-VM's QEMU had exited by itself; it sleeps as its disk, and its next wake "
                            "boots it from there", sandbox=self.id, code=self._proc.returncode if self._proc else None)
                return await self._sleep_stopped()
            if self.state is not SandboxState.RUNNING:
                raise SandboxStateError(f"sandbox {self.id} is {self.state.value}; only a running or stopped sandbox "
                                        "can sleep", hint="call wake() first")
            if self._disk_full:  # its snapshot would not fit either; it sleeps once resumed
                raise paused_error(self.id)
            if self._driver.drop_caches_on_sleep:
                # Costs a process start in the guest (1-2 s under TCG) and saves nothing: freed pages keep their
                # bytes, so they stay in the RAM file or delta. Off by default; kept for hosts that zero on free.
                try:
                    await self.exec(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], timeout=30)
                except ChannelError as e:
                    log.warning("drop caches before sleep failed", sandbox=self.id, error=str(e))
            elif self._channel is not None:
                # Flush the guest's dirty page cache (no process start: the supervisor calls sync()) so the disk
                # alone holds every file written before the sleep, should the memory snapshot ever be unusable.
                try:
                    await self._channel.call("sys.sync", {}, timeout=30)
                except ChannelError as e:
                    log.warning("guest sync before sleep failed", sandbox=self.id, error=str(e))
            info = await self._snapshot_to(self.dir / "snapshot", keep_running=False)
            return info

    def _qemu_gone(self) -> bool:
        """Whether this running sandbox's QEMU has exited (ours: reaped; one re-adopted after a host restart: its pid
        no longer a QEMU of this sandbox)."""
        if self._proc is not None:
            return self._proc.poll() is not None
        pid = self.pid
        return not pid or not pid_is_ours(pid, str(self.run_dir))

    async def _sleep_stopped(self) -> SnapshotInfo:
        """A stopped guest (the host stopped it: stuck past its turn's timeout, or it broke the channel protocol)
        sleeps as its disk alone: its memory is gone, so its RAM file goes too, and its next wake boots from the
        disk (``slept_stopped``: a cold boot, not a snapshot found missing)."""
        await self._teardown()
        if self.ram_mode == "shared":
            (self.dir / "ram").unlink(missing_ok=True)
        shutil.rmtree(self.dir / "snapshot", ignore_errors=True)
        self._set_state(SandboxState.SLEEPING, snapshot=None, slept_stopped=True)
        disk = self.dir / "disk.qcow2"
        return SnapshotInfo(self.id, disk, allocated(disk), time.time(), includes_memory=False)

    async def wake(self) -> None:
        async with self._lock:
            await self._wake_locked()

    async def stop(self) -> None:
        async with self._lock:
            if self.state is SandboxState.RUNNING and self._channel is not None:
                try:
                    await self._channel.call("sys.sync", {}, timeout=10)
                except ChannelError:
                    pass
            await self._teardown()
            if self.state is not SandboxState.DESTROYED:
                self._set_state(SandboxState.STOPPED, snapshot=None)

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[None]:
        """The guest paused for the block, with a memory snapshot of that instant in ``snapshot/`` (device state, the
        RAM delta or, for an own RAM file, that file itself while paused; ``snapshot.json`` marked ``live``): a copy
        of the directory taken inside the block (a fleet ships one) wakes elsewhere exactly there
        (``adopt_fetched``). Here the guest runs on afterwards and that snapshot is never used: the disk moves on."""
        async with self._lock:
            if self.state is not SandboxState.RUNNING or self._qmp is None or self.pid is None:
                raise SandboxStateError(f"sandbox {self.id} is {self.state.value}; only a running sandbox can be frozen",
                                        hint="its state is shipped when it sleeps")
            if self._channel is not None:
                try:  # the disk alone then holds every file, should the copy's memory image be unusable
                    await self._channel.call("sys.sync", {}, timeout=30)
                except ChannelError as e:
                    log.warning("guest sync before freeze failed", sandbox=self.id, error=str(e))
            qmp = self._qmp
            await qmp.execute("stop")  # also drains and flushes the disk: the file is consistent while paused
            try:
                await self._live_snapshot()
                yield
            finally:
                with contextlib.suppress(QMPError):
                    await qmp.execute("cont")
                    await self._set_guest_clock()

    async def destroy(self) -> None:
        async with self._lock:
            await self._teardown()
            tpl = self._meta.get("template_dir")
            if tpl:
                (Path(tpl) / "children" / self.id).unlink(missing_ok=True)
                microvm_templates.collect(Path(tpl))
            microvm_user.release(self.dir)  # its QEMU is gone: the uid goes back to the machine's registry
            shutil.rmtree(self.dir, ignore_errors=True)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._meta["state"] = SandboxState.DESTROYED.value
            self._driver._open.pop(self.id, None)

    async def stats(self) -> SandboxStats:
        rss = 0
        pid = self.pid if self.state is SandboxState.RUNNING else None
        if pid and self._channel is not None and not self._channel.closed:
            # Written data sits in the guest's page cache for up to 30 s; disk_bytes should count it.
            try:
                await self._channel.call("sys.sync", {}, timeout=10)
            except ChannelError:
                pass
        if pid:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
            except OSError:
                pass
        snapshot_bytes = allocated(self.dir / "snapshot")
        if self.state is SandboxState.SLEEPING and self.ram_mode == "shared":
            snapshot_bytes += allocated(self.dir / "ram")
        return SandboxStats(
            state=self.state,
            host_rss_bytes=rss,
            disk_bytes=allocated(self.dir / "disk.qcow2"),
            snapshot_bytes=snapshot_bytes,
            checkpoint_bytes=allocated(self.dir / "checkpoints"),
            pid=pid,
        )
