"""One micro-VM sandbox: a QEMU ``-M microvm`` guest, asleep as a snapshot when idle.

Sleep saves device state (``xen-save-devices-state``) next to guest RAM that already lives in a file; wake starts
the same command line with ``-incoming defer`` and loads it. A fork maps its template's RAM privately and saves
only the pages it changed. Checkpoints add the disk's qcow2 internal snapshot and the pages changed since the last
one (``microvm_ram_chain``). The design and its reasons: docs/decisions/0002-microvm-snapshots.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import shutil
import subprocess
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from moorage.log import get_logger
from moorage.sandbox import microvm_memfd
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_snapshots as snapshots
from moorage.sandbox import microvm_templates, microvm_user
from moorage.sandbox.base import (
    ChannelError,
    RemoteError,
    Sandbox,
    SandboxError,
    SandboxState,
    SandboxStateError,
    SandboxStats,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotInfo,
)
from moorage.sandbox.channel import Channel
from moorage.sandbox.microvm_checkpointing import Checkpointing
from moorage.sandbox.image import GuestImage
from moorage.sandbox import microvm_net
from moorage.sandbox.microvm_files import allocated, write_json
from moorage.sandbox.microvm_qemu import (
    VMConfig,
    VMPaths,
    build_argv,
    console_pipe,
    console_reattach,
    console_release,
    console_settled,
    kill_pid,
    pid_is_ours,
    run_dir_for,
    ensure_private_dir,
    spawn,
)
from moorage.sandbox.qmp import QMPClient, QMPError

if TYPE_CHECKING:
    from moorage.sandbox.microvm import MicroVMDriver

log = get_logger(__name__)

COLD_BOOT_TIMEOUT_S = 90.0
WAKE_TIMEOUT_S = 30.0
#: How long a sleep waits for QEMU to quit (closing its disk cleanly) before it kills it.
QUIT_WAIT_S = 5.0
#: Which sandbox object holds the (single-client) QEMU sockets of a sandbox directory in this process.
_ATTACHED: "weakref.WeakValueDictionary[str, MicroVMSandbox]" = weakref.WeakValueDictionary()


class BootError(SandboxError):
    """The guest did not come up; the message carries the tail of its console and QEMU's log."""

    code = "sandbox-boot"



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

    async def caught_up(self) -> None:
        task = self.behind
        if task is not None:
            await asyncio.wait([task])  # a cancelled waiter leaves the write running
            if self.behind is task:
                self.behind = None


class MicroVMSandbox(Checkpointing, Sandbox):
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

    # --- state ----------------------------------------------------------------------------------------------

    @property
    def state(self) -> SandboxState:
        return SandboxState(self._meta["state"])

    @property
    def channel(self) -> Channel:
        if self.state is not SandboxState.RUNNING or self._channel is None or self._channel.closed:
            raise SandboxStateError(f"sandbox {self.id} is {self.state.value}, its channel is not connected", hint="call wake() first")
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

    # --- process plumbing -----------------------------------------------------------------------------------

    async def _launch(self, incoming: bool, paused: bool = False) -> None:
        ensure_private_dir(self.run_dir)
        for s in ("qmp.sock", "chan.sock"):
            (self.run_dir / s).unlink(missing_ok=True)
        paths = self._paths()
        if self.ram_mode == "delta" and os.geteuid() == 0 and not microvm_memfd.ready(self._ram_path()):
            # A fork's QEMU maps its template's RAM from a sealed memfd: the first launch in this process copies
            # the file into it, off the event loop (later ones find it made, without a thread hop per wake).
            await asyncio.to_thread(microvm_memfd.sealed_ram, self._ram_path())
        if self._net is not None:
            self._net.close()
            self._net = None
        if self._vm_config().nic:
            self._net = await asyncio.to_thread(microvm_net.VMNetwork.create)
        try:
            self._proc = spawn(self._argv(incoming, paused), self.dir / "qemu.log",
                               pass_fds=(self._net.tap_fd,) if self._net is not None and self._net.tap_fd is not None else ())
        finally:
            if self._net is not None:
                self._net.release_tap()  # QEMU holds its own; the tap goes when QEMU does
        (self.dir / "qemu.pid").write_text(str(self._proc.pid))
        self._meta["pid"] = self._proc.pid
        deadline = time.monotonic() + 10
        while not paths.qmp_sock.exists():
            if self._proc.poll() is not None:
                raise BootError(f"QEMU exited at start (code {self._proc.returncode}): {self._log_tail()}", hint="check qemu.log in the sandbox directory")
            if time.monotonic() > deadline:
                raise BootError("QEMU did not create its monitor socket within 10 s", hint="the host may be overloaded")
            await asyncio.sleep(0.002)
        self._qmp = await QMPClient.connect(str(paths.qmp_sock))
        _ATTACHED[str(self.dir)] = self

    def _log_tail(self) -> str:
        if self._proc is not None and self._proc.poll() is not None:
            console_settled(console_pipe(self.dir / "console.log"))  # its last lines, read in the reader's batch
        out = []
        for name in ("qemu.log", "console.log"):
            try:
                text = (self.dir / name).read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                out.append(f"{name}: ...{text[-600:]}")
        return " | ".join(out) or "no output"

    async def _connect_channel(self, timeout: float, first: Callable[[], tuple[str, dict[str, Any]]] | None = None) -> Any:
        """Connect to the guest's port and wait for its first answer: to ``ping``, or to the call ``first()`` makes.

        A wake makes its first call the after-wake fix-up itself, so the first reply also means the guest's clock
        (and a fork's random generator) are right: one round trip to a cold guest instead of two. ``first`` is
        called again for each attempt (the clock it sends must be current). An error answer is not retried.
        """
        deadline = time.monotonic() + timeout
        path = str(self._paths().chan_sock)
        last: Exception | None = None
        attempt = 0  # short first timeouts: a call sent before the guest reads is retried soon, not after 2 s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise BootError(f"QEMU exited (code {self._proc.returncode}) before the guest answered: {self._log_tail()}")
            try:
                if self._channel is None or self._channel.closed:
                    # The guest's end of the port may still remember request ids of a connection from before a
                    # sleep (it cannot see a disconnect while frozen); start this session's ids where none can clash.
                    self._channel = await Channel.open_unix(path, name=f"microvm:{self.id}",
                                                            first_id=secrets.randbelow(1 << 40) + (1 << 20),
                                                            max_guest_inflight=self._driver.config.guest_calls_per_channel)
                    channel = self._channel
                    channel.on_protocol_error = lambda: self._protocol_broken(channel)
                    microvm_net.bind_channel(channel, self._net)
                wait = min(0.25 * (2 ** attempt), 2.0, max(deadline - time.monotonic(), 0.1))
                method, params = first() if first is not None else ("ping", {})
                return await self._channel.call(method, params, timeout=wait)
            except RemoteError:
                raise
            except ChannelError as e:
                last = e
                attempt += 1
                await asyncio.sleep(0.01)
        raise BootError(f"guest of sandbox {self.id} did not answer within {timeout:.0f} s ({last}): {self._log_tail()}", hint="destroy the sandbox or check the image (`moorage image build`)")

    async def _reconnect(self, accept: Callable[[dict[str, Any]], bool], timeout: float = COLD_BOOT_TIMEOUT_S) -> None:
        """A new channel to the guest, kept once its answer to ``ping`` is one ``accept`` takes (a new supervisor's,
        after ``sys.restart``; until then the old one may still answer)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._channel is not None:
                await self._channel.close("connecting to the guest again")
                self._channel = None
            if accept(await self._connect_channel(max(deadline - time.monotonic(), 0.1))):
                return
            if time.monotonic() > deadline:
                raise BootError(f"the guest of sandbox {self.id} did not restart within {timeout:.0f} s: "
                                f"{self._log_tail()}")
            await asyncio.sleep(0.02)

    def _protocol_broken(self, channel: Channel) -> None:
        """A guest that broke the channel protocol is stopped at once (disk kept, memory dropped), not trusted with
        a reconnect: QEMU is killed and the sandbox marked stopped before any other task sees it running; the next
        wake cold-boots it (and tears down what is left first)."""
        if self._channel is not channel or self.state is not SandboxState.RUNNING:
            return
        log.warning("guest broke the channel protocol; stopping it", sandbox=self.id, error=str(channel.protocol_error))
        pid = self.pid
        if pid and (self._proc is not None or pid_is_ours(pid, str(self.run_dir))):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self._set_state(SandboxState.STOPPED, snapshot=None)
        asyncio.get_running_loop().create_task(self._reap_after_protocol_error(channel))

    async def _reap_after_protocol_error(self, channel: Channel) -> None:
        async with self._lock:
            if self._channel is channel:  # not woken meanwhile (a cold boot tears down what is left itself)
                await self._teardown()
                self._save_meta()

    async def _teardown(self, *, quit: bool = False) -> None:
        """Kill QEMU, wait until it is gone, and drop connections (no snapshot). ``quit``: ask QEMU to exit instead
        and wait for it (``QUIT_WAIT_S``), so it closes its disk cleanly; killed if it does not."""
        self._prepared = False
        if self._channel is not None:
            await self._channel.close("sandbox stopped")
            self._channel = None
        if quit and self._qmp is not None and self._proc is not None and self._proc.poll() is None:
            proc = self._proc
            with contextlib.suppress(QMPError):
                await self._qmp.execute("quit", timeout=QUIT_WAIT_S)
            try:
                await asyncio.to_thread(proc.wait, QUIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("QEMU did not quit; killing it (its disk is repaired when next opened)", sandbox=self.id)
        if self._qmp is not None:
            await self._qmp.close()
            self._qmp = None
        pid = self._meta.get("pid")
        if self._proc is not None and self._proc.poll() is not None:
            pass  # exited (and reaped): its pid may already be another process's
        elif pid and (self._proc is not None or pid_is_ours(pid, str(self.run_dir))):
            kill_pid(pid, self._proc)
        self._proc = None
        console_release(console_pipe(self.dir / "console.log"), stop=False)  # its reader ends with QEMU's output
        if self._net is not None:
            self._net.close()
            self._net = None
        self._meta["pid"] = None
        (self.dir / "qemu.pid").unlink(missing_ok=True)
        for s in ("qmp.sock", "chan.sock"):
            (self.run_dir / s).unlink(missing_ok=True)

    async def _reattach(self) -> bool:
        """After a host restart: connect to a still-running QEMU of this sandbox."""
        pid = self._meta.get("pid")
        if not pid or not pid_is_ours(pid, str(self.run_dir)):
            return False
        # QEMU's monitor and channel sockets take one client each. A previous driver instance in this process
        # (the host before a restart, in tests and in-process reloads) gives its connections up, as a dead
        # process's would be.
        previous = _ATTACHED.get(str(self.dir))
        if previous is not None and previous is not self:
            await previous._detach()
        try:
            self._qmp = await QMPClient.connect(str(self._paths().qmp_sock))
            _ATTACHED[str(self.dir)] = self
            if not console_reattach(console_pipe(self.dir / "console.log"), pid, str(self.run_dir)):
                log.warning("re-attached without its console log", sandbox=self.id)
            if self._vm_config().nic and self._net is None:
                try:  # its namespace outlived the host process through QEMU's tap: serve the gateway there again
                    self._net = await asyncio.to_thread(microvm_net.recover, pid)
                except microvm_net.NicUnavailable as e:
                    log.warning("re-attached without its network until its next wake", sandbox=self.id, error=str(e))
            status = await self._qmp.execute("query-status")
            if not status.get("running"):
                await self._qmp.execute("cont")
            await self._connect_channel(WAKE_TIMEOUT_S)
            return True
        except (QMPError, BootError) as e:
            log.warning("re-attach failed, killing QEMU", sandbox=self.id, error=str(e))
            await self._teardown()
            return False

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
            if self.state is not SandboxState.RUNNING:
                raise SandboxStateError(f"sandbox {self.id} is {self.state.value}; only a running sandbox can sleep", hint="call wake() first")
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

    def _validate_snapshot(self, snap_dir: Path, record: dict[str, Any] | None) -> dict[str, Any]:
        return snapshots.validate(self.id, self.dir, snap_dir, record, self._vm_config().layout_id())

    async def wake(self) -> None:
        async with self._lock:
            await self._wake_locked()

    @property
    def prepared(self) -> bool:
        return self._prepared and self._proc is not None and self._proc.poll() is None

    async def prepare(self) -> bool:
        """Start QEMU for this sleeping sandbox and load its snapshot with the guest held paused, so the next
        ``wake`` only resumes it (no process start, no state to load). Costs a QEMU process (its RSS) while
        prepared, no guest CPU. Returns False when there is nothing to prepare or the snapshot is unusable (the
        wake then takes its usual path, cold-boot fallback included)."""
        async with self._lock:
            if self.state is not SandboxState.SLEEPING or self.prepared or not self._meta.get("snapshot"):
                return False
            snap_dir = self.dir / "snapshot"
            ph = snapshots.Phases()
            launch = asyncio.create_task(self._launch(incoming=True, paused=True))
            try:
                record = await asyncio.to_thread(self._validate_snapshot, snap_dir, self._meta.get("snapshot"))
                ph.mark("validate")
            except BaseException as e:
                await asyncio.gather(launch, return_exceptions=True)
                await self._teardown()
                if isinstance(e, (SnapshotCorrupt, SnapshotIncompatible)):
                    return False
                raise
            try:
                await self._restore(snap_dir, record, launch, ph, paused=True)
            except (SnapshotCorrupt, SnapshotIncompatible):
                return False
            self._prepared = True
            self._save_meta()  # its pid: a host that restarts kills this QEMU instead of leaving it behind
            log.info("prepared", sandbox=self.id, kind=record["kind"], ms=ph.total(), **ph.ms)
            return True

    async def unprepare(self) -> None:
        """Stop the paused QEMU of a prepared sandbox; it stays asleep on disk, its snapshot untouched."""
        async with self._lock:
            if self._prepared and self.state is SandboxState.SLEEPING:
                await self._teardown()
                self._save_meta()

    async def _wake_locked(self) -> None:
        if self.state is SandboxState.RUNNING:
            return
        if self.state is SandboxState.DESTROYED:
            raise SandboxStateError(f"sandbox {self.id} is destroyed")
        self.last_wake_fallback = None
        if self._prepared:
            self._prepared = False
            if await self._resume_prepared():
                return
        if self.state in (SandboxState.CREATED, SandboxState.STOPPED) and not self._meta.get("snapshot"):
            await self._cold_boot()
            return
        snap_dir = self.dir / "snapshot"
        ph = snapshots.Phases()
        try:
            # QEMU starts while the snapshot's checksums are verified (both take tens of ms).
            launch = asyncio.create_task(self._launch(incoming=True))
            try:
                record = await asyncio.to_thread(self._validate_snapshot, snap_dir, self._meta.get("snapshot"))
                ph.mark("validate")
            except BaseException:
                try:
                    await launch
                except BaseException:
                    pass
                await self._teardown()
                raise
            await self._restore(snap_dir, record, launch, ph)
        except (SnapshotCorrupt, SnapshotIncompatible) as e:
            log.warning("snapshot unusable, cold boot from disk", sandbox=self.id, error=str(e))
            self.last_wake_fallback = e
            await self._cold_boot()

    async def _resume_prepared(self) -> bool:
        """Wake a prepared sandbox: resume its paused guest. False (QEMU torn down) if that QEMU is gone."""
        ph = snapshots.Phases()
        if self._qmp is None or self._proc is None or self._proc.poll() is not None:
            await self._teardown()
            return False
        try:
            await self._qmp.execute("cont")
            await self._qmp.next_event("RESUME", timeout=WAKE_TIMEOUT_S)
        except QMPError as e:
            log.warning("prepared QEMU did not resume; waking the usual way", sandbox=self.id, error=str(e))
            await self._teardown()
            return False
        ph.mark("resume")
        await self._run_restored(ph, bool(self._meta.get("fresh_fork")), str(self._meta["snapshot"]["kind"]))
        return True

    async def _restore(self, snap_dir: Path, record: dict[str, Any], launch: "asyncio.Task[None]", ph: snapshots.Phases,
                       *, paused: bool = False) -> None:
        fresh_fork = bool(self._meta.get("fresh_fork"))
        try:
            if record["kind"] == "delta":
                # The delta goes into QEMU's private RAM mapping as soon as it exists, while QEMU finishes starting.
                results = await asyncio.gather(launch, self._apply_delta_when_mapped(snap_dir), return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
            else:
                await launch
            ph.mark("qemu_start_and_ram")
            assert self._qmp is not None and self._proc is not None
            fd = os.open(snap_dir / "dev.state", os.O_RDONLY)
            try:
                await self._qmp.execute("getfd", {"fdname": "devstate"}, fds=[fd])
            finally:
                os.close(fd)
            await self._qmp.execute("migrate-incoming", {"uri": "fd:devstate"})
            try:
                if paused:
                    await self._incoming_done()
                else:
                    await self._qmp.next_event("RESUME", timeout=WAKE_TIMEOUT_S)
            except QMPError as e:
                raise SnapshotCorrupt(f"QEMU could not load the snapshot of {self.id}: {self._log_tail()}", hint="it cold-boots from its disk") from e
            ph.mark("device_state")
        except SnapshotCorrupt:
            await self._teardown()
            raise
        except BaseException:
            await self._teardown()
            self._set_state(SandboxState.SLEEPING)  # the guest never ran: the snapshot is still good
            raise
        if paused:
            return  # loaded, guest not running: the snapshot is still the sandbox's state
        await self._run_restored(ph, fresh_fork, record["kind"])

    async def _incoming_done(self) -> None:
        """Wait until a paused (-S) QEMU has loaded the incoming state (it then stays paused, no RESUME event)."""
        assert self._qmp is not None
        deadline = time.monotonic() + WAKE_TIMEOUT_S
        while True:
            status = (await self._qmp.execute("query-status")).get("status")
            if status != "inmigrate":
                if status != "paused":
                    raise QMPError(f"incoming state ended in status {status!r}")
                return
            if time.monotonic() > deadline:
                raise QMPError(f"QEMU did not load the state within {WAKE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.002)

    async def _run_restored(self, ph: snapshots.Phases, fresh_fork: bool, kind: str) -> None:
        """The restored guest runs: record it running and wait for its first reply (which fixes clock and CRNG)."""
        # The guest runs from here, so the snapshot is spent: a shared RAM file no longer matches the old device
        # state and the disk moves on. A crash while awake re-adopts the live QEMU or cold-boots from disk, never
        # resumes an older memory image.
        persist = asyncio.create_task(asyncio.to_thread(self._set_state, SandboxState.RUNNING, snapshot=None, fresh_fork=False))
        try:
            await self._first_reply_after_wake(fresh_fork)
            ph.mark("first_reply")
            await persist
        except BaseException:
            await asyncio.gather(persist, return_exceptions=True)
            await self._teardown()
            self._set_state(SandboxState.STOPPED, snapshot=None)
            raise
        self.last_wake_mode = "snapshot"
        self.last_wake_phases = dict(ph.ms)
        log.info("woke", sandbox=self.id, kind=kind, ms=ph.total(), **ph.ms)
        # The first reply's clock was read on the host before the cold guest got to it (tens of ms under TCG): set
        # once more now that the guest is warm, off the wake's path.
        self._clock_again = asyncio.get_running_loop().create_task(self._set_guest_clock(), name=f"clock-{self.id}")

    async def _apply_delta_when_mapped(self, snap_dir: Path) -> None:
        """Write a fork's saved RAM delta into the starting QEMU's private mapping of the template RAM.

        QEMU maps guest RAM early in its start-up and does not write it before the incoming migration, so the
        delta can go in while the rest of QEMU initialises (the monitor answers only after that).
        """
        size = self._vm_config().memory_mib << 20
        deadline = time.monotonic() + 10
        while True:
            proc = self._proc
            if proc is not None:
                if proc.poll() is not None:
                    return  # QEMU exited at start: the launch reports why
                try:
                    m = ram.find_mapping(proc.pid, self._ram_path())
                    if m.end - m.start >= size:
                        break
                except (ram.RamError, OSError):
                    pass
            if time.monotonic() > deadline:
                raise BootError("QEMU did not map the guest RAM within 10 s", hint="the host may be overloaded")
            await asyncio.sleep(0.001)
        await asyncio.to_thread(ram.apply_delta, proc.pid, m, snap_dir)

    async def _first_reply_after_wake(self, fresh_fork: bool) -> None:
        """The first call to a woken guest sets its clock (it stood still while asleep) and, for a new fork, reseeds
        its kernel CRNG so forks of one template never share a random stream. One RPC to the image's VM extension,
        no process start; its answer is the wake's first channel reply."""
        seed = base64.b64encode(secrets.token_bytes(64)).decode() if fresh_fork else None

        def after_wake() -> tuple[str, dict[str, Any]]:
            params: dict[str, Any] = {"time": time.time()}
            if seed is not None:
                params["seed"] = seed
            return "vm.after_wake", params

        try:
            await self._connect_channel(WAKE_TIMEOUT_S, first=after_wake)
        except RemoteError as e:
            if fresh_fork:
                raise SandboxError(f"could not reseed the random generator of fork {self.id}: {e}", hint="rebuild the image (`moorage image build`) and re-make the template") from e
            log.warning("could not set the guest clock after wake", sandbox=self.id, error=str(e))

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

    async def _detach(self) -> None:
        if _ATTACHED.get(str(self.dir)) is self:
            del _ATTACHED[str(self.dir)]
        if self._channel is not None:
            await self._channel.close("driver closed")
            self._channel = None
        if self._qmp is not None:
            await self._qmp.close()
            self._qmp = None
        # QEMU runs on: whoever re-attaches reads its console (until then what the guest prints there is dropped).
        console_release(console_pipe(self.dir / "console.log"))
        if self._net is not None:  # QEMU keeps its tap; whoever re-attaches finds the namespace through it
            self._net.close()
            self._net = None
