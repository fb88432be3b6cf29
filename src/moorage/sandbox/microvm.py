"""The micro-VM sandbox driver: one QEMU ``-M microvm`` guest per sandbox, asleep as a snapshot when idle.

Sleep saves device state (``xen-save-devices-state``) next to guest RAM that already lives in a file; wake starts
the same command line with ``-incoming defer`` and loads it. Forks map a template's RAM privately and save only
the pages they changed. The design and its reasons: docs/decisions/0002-microvm-snapshots.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from moorage.config import Config
from moorage.errors import ConflictError, InvalidInput
from moorage.log import get_logger
from moorage.sandbox import microvm_memfd
from moorage.sandbox import microvm_ram as ram
from moorage.sandbox import microvm_ram_chain as ram_chain
from moorage.sandbox import microvm_user
from moorage.sandbox.accel import choose_accel, probe_kvm
from moorage.sandbox.base import (
    Capabilities,
    ChannelError,
    CheckpointInfo,
    RemoteError,
    Sandbox,
    SandboxDriver,
    SandboxError,
    SandboxNotFound,
    SandboxSpec,
    SandboxState,
    SandboxStateError,
    SandboxStats,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotInfo,
    TemplateRef,
    validate_id,
)
from moorage.sandbox.channel import Channel
from moorage.sandbox.image import GuestImage, ImageBuilder
from moorage.sandbox import microvm_net
from moorage.sandbox.microvm_qemu import (
    VMConfig,
    VMPaths,
    build_argv,
    kernel_cmdline,
    kill_pid,
    pid_is_ours,
    qemu_version,
    run_dir_for,
    ensure_private_dir,
    spawn,
)
from moorage.sandbox.qmp import QMPClient, QMPError

log = get_logger(__name__)

COLD_BOOT_TIMEOUT_S = 90.0
WAKE_TIMEOUT_S = 30.0
#: How long a sleep waits for QEMU to quit (closing its disk cleanly) before it kills it.
QUIT_WAIT_S = 5.0
_TEMPLATES = ".templates"
#: The empty overlay on a template's disk that each fork's disk starts as (a copy, no qemu-img run per fork).
CHILD_DISK = "child.qcow2"
#: Which sandbox object holds the (single-client) QEMU sockets of a sandbox directory in this process.
_ATTACHED: "weakref.WeakValueDictionary[str, MicroVMSandbox]" = weakref.WeakValueDictionary()


class BootError(SandboxError):
    """The guest did not come up; the message carries the tail of its console and QEMU's log."""

    code = "sandbox-boot"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic and durable: a crash leaves the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _allocated(path: Path) -> int:
    """Bytes a file or tree really uses on disk (sparse RAM files are mostly holes)."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of ``src`` (a 256 MiB RAM file holds ~half holes)."""
    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.truncate(size)
        ifd, ofd = fi.fileno(), fo.fileno()
        off = 0
        while off < size:
            try:
                data = os.lseek(ifd, off, os.SEEK_DATA)
            except OSError:
                break  # no more data
            hole = os.lseek(ifd, data, os.SEEK_HOLE)
            pos = data
            while pos < hole:
                n = os.copy_file_range(ifd, ofd, hole - pos, pos, pos)
                if n <= 0:
                    break
                pos += n
            off = hole
        os.fsync(ofd)


async def _qemu_img(*args: str, sandbox_dir: Path | None = None) -> None:
    """Run ``qemu-img``; on failure remove ``sandbox_dir`` (a half-made sandbox) and raise ``SandboxError``."""
    r = await asyncio.create_subprocess_exec("qemu-img", *args, stderr=asyncio.subprocess.PIPE)
    _, err = await r.communicate()
    if r.returncode != 0:
        if sandbox_dir is not None:
            shutil.rmtree(sandbox_dir, ignore_errors=True)
        raise SandboxError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()}")


def _qcow2_backing(path: Path) -> str | None:
    """The backing file name written in a qcow2 header (None: no backing, or not a qcow2 file)."""
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:4] != b"QFI\xfb":
            return None
        offset, size = int.from_bytes(head[8:16], "big"), int.from_bytes(head[16:20], "big")
        if not offset or not size:
            return None
        f.seek(offset)
        return f.read(size).decode(errors="replace")


def _rebase(disk: Path, backing: Path, fmt: str) -> bool:
    """Point ``disk``'s qcow2 header at ``backing`` (same bytes, another path: ``-u`` copies nothing). Blocking;
    returns whether the header changed. A read-only file (a template's disk) is made writable for the call."""
    if _qcow2_backing(disk) == str(backing):
        return False
    mode = disk.stat().st_mode & 0o777
    if not mode & 0o200:
        disk.chmod(mode | 0o200)
    try:
        r = subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(backing), "-F", fmt, str(disk)],
                           capture_output=True, text=True)
    finally:
        if not mode & 0o200:
            disk.chmod(mode)
    if r.returncode != 0:
        raise SandboxError(f"qemu-img rebase of {disk} failed: {r.stderr.strip()}",
                           hint="check the disk file; it may be damaged")
    ram.fsync_path(disk)
    return True


class _Phases:
    """Milliseconds per step of a sleep or wake, logged with it (where the time goes on a given host)."""

    def __init__(self) -> None:
        self._t = time.monotonic()
        self.ms: dict[str, int] = {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.ms[name] = round((now - self._t) * 1000)
        self._t = now

    def total(self) -> int:
        return sum(self.ms.values())


def _collect_template(tdir: Path) -> None:
    """Remove a deleted template once no fork depends on its RAM and disk any more."""
    children = tdir / "children"
    if (tdir / "deleted").exists() and not (children.exists() and any(children.iterdir())):
        microvm_memfd.release(tdir / "ram")
        microvm_user.release(tdir)  # the group id its forks had
        shutil.rmtree(tdir, ignore_errors=True)


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


class MicroVMSandbox(Sandbox):
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
        _write_json(self.dir / "meta.json", self._meta)

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

    async def _snapshot_to(self, target: Path, *, keep_running: bool, ram_base: Path | None = None,
                           disk_tag: str | None = None, behind: bool = False) -> SnapshotInfo:
        """Pause, save device state + RAM (+ flush disk) into ``target``, then resume or kill QEMU. ``disk_tag`` (a
        checkpoint): the disk's qcow2 internal snapshot of that name is taken in the same pause, and the RAM is
        stored as the pages changed since the checkpoint ``ram_base`` (``microvm_ram_chain``), read while paused
        and written after the guest runs again: before this returns, or with ``behind`` by a task the sandbox's
        lock waits for (``_VerbLock``), so the caller goes on once the guest runs."""
        assert self._qmp is not None and self.pid is not None
        ph = _Phases()
        new = target.with_name(target.name + ".new")
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        cap: ram_chain.Capture | None = None
        # The channel stays connected through the pause: the guest then never sees its port close, and after a
        # wake it simply reads the new connection's frames (no reopen, no frames dropped in between).
        await self._qmp.execute("stop")  # also drains and flushes the disk
        paused = True
        clock: asyncio.Task[None] | None = None
        try:
            await self._qmp.save_device_state(new / "dev.state")  # by descriptor: QEMU cannot reach the path
            if disk_tag is not None:
                await self._disk_snapshot(disk_tag)  # the disk at the same instant as memory and devices
            ph.mark("pause_and_device_state")
            record: dict[str, Any] = {
                "kind": self.ram_mode,
                "qemu": qemu_version(),
                "layout": self._vm_config().layout_id(),
                "image": self._meta["image_id"],
                "created_at": time.time(),
            }
            # The file work below runs on worker threads: on the event loop it held every other request of the host
            # (and a reply just handed over, a checkpoint being taken right after the turn's reply) for its duration.
            if self.ram_mode == "delta" and disk_tag is not None:
                m = ram.find_mapping(self.pid, self._ram_path())
                cap = await asyncio.to_thread(ram_chain.capture, self.pid, m, self._ram_path(), ram_base, new)
                ph.mark("ram_capture")
                await self._qmp.execute("cont")  # the guest runs on while its pages are compressed and stored
                paused = False
                clock = asyncio.create_task(self._set_guest_clock())
                if behind:
                    self.last_snapshot_phases = dict(ph.ms)  # the pause's steps; the write's once it is done
                    self._lock.behind = asyncio.get_running_loop().create_task(
                        self._write_behind(cap, new, target, record, ph, clock), name=f"checkpoint-write-{self.id}")
                    clock = None
                    return SnapshotInfo(self.id, target, 0, record["created_at"], True)
            elif self.ram_mode == "delta":
                m = ram.find_mapping(self.pid, self._ram_path())
                record["delta_bytes"] = await asyncio.to_thread(ram.save_delta, self.pid, m, self._ram_path(), new)
                record["delta_xxh3"] = await asyncio.to_thread(ram.delta_digest, new / "ram.delta")
                ph.mark("ram_delta")
            elif keep_running:
                await asyncio.to_thread(_sparse_copy, self.dir / "ram", new / "ram")  # a checkpoint's own copy of shared RAM
                record["ram_checksum"] = await asyncio.to_thread(ram.file_digest, new / "ram")
            else:
                await asyncio.to_thread(ram.fsync_path, self.dir / "ram")
                record["ram_checksum"] = await asyncio.to_thread(ram.file_digest, self.dir / "ram")
            ph.mark("ram")
            await self._commit_snapshot(cap, new, target, record, keep_running, ph)
        finally:
            if keep_running and paused and self._qmp is not None:
                await self._qmp.execute("cont")  # a checkpoint that failed leaves the guest running, as it was
                paused = False
                clock = asyncio.create_task(self._set_guest_clock())
            if clock is not None:
                await clock
        if not keep_running:
            # QEMU quits rather than being killed: it closes the disk cleanly (its refcounts written, the image
            # no longer marked dirty), so the wake and anything that ships the directory find a clean image.
            await self._teardown(quit=True)
            self._set_state(SandboxState.SLEEPING, snapshot=record)
        ph.mark("commit")
        log.info("snapshot", sandbox=self.id, kind=record["kind"], keep_running=keep_running, ms=ph.total(), **ph.ms)
        self.last_snapshot_phases = dict(ph.ms)
        size = _allocated(target) + (0 if self.ram_mode == "delta" or keep_running else _allocated(self.dir / "ram"))
        return SnapshotInfo(self.id, target, size, record["created_at"], True)

    async def _commit_snapshot(self, cap: "ram_chain.Capture | None", new: Path, target: Path, record: dict[str, Any],
                               keep_running: bool, ph: _Phases) -> None:
        """Store a captured checkpoint's pages (``cap``), sync the directory ``new`` and put it in ``target``'s place."""
        if cap is not None:
            saved = await asyncio.to_thread(ram_chain.write, cap, new)
            record.update(delta_bytes=saved["delta_bytes"], stored_bytes=saved["stored_bytes"], ram_bytes=saved["ram_bytes"])
            ph.mark("ram_write")
        await asyncio.to_thread(ram.fsync_path, new / "dev.state")
        await asyncio.to_thread(ram.fsync_path, self.dir / "disk.qcow2")  # the disk snapshot's table too
        record["dev_sha256"] = await asyncio.to_thread(ram.sha256_file, new / "dev.state")
        if keep_running:
            _write_json(new / "snapshot.json", record)  # checkpoints carry their own record; sleeps use meta.json
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.rename(target, old)
        os.rename(new, target)
        _fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)

    async def _write_behind(self, cap: "ram_chain.Capture", new: Path, target: Path, record: dict[str, Any],
                            ph: _Phases, clock: "asyncio.Task[None]") -> None:
        """A checkpoint's files, written while the guest runs on (``checkpoint(durable=False)``). A failure leaves
        no checkpoint of that name (it is logged; a rollback to it is refused as to any missing one)."""
        try:
            await self._commit_snapshot(cap, new, target, record, True, ph)
            ph.mark("commit")
            log.info("snapshot", sandbox=self.id, kind=record["kind"], keep_running=True, behind=True,
                     ms=ph.total(), **ph.ms)
            self.last_snapshot_phases = dict(ph.ms)
        except Exception as e:  # noqa: BLE001 - the guest runs on; only this checkpoint is lost
            log.warning("checkpoint not written", sandbox=self.id, checkpoint=target.name, error=str(e))
            shutil.rmtree(new, ignore_errors=True)
            if self._qmp is not None:  # its disk snapshot would keep clusters that nothing lists
                with contextlib.suppress(QMPError):
                    await self._qmp.execute("blockdev-snapshot-delete-internal-sync",
                                            {"device": "disk", "name": f"ckpt-{target.name}"})
        finally:
            await clock

    async def _set_guest_clock(self) -> None:
        """After a pause the guest runs on from (a checkpoint, a freeze): its clock stood still through the pause,
        so it is set again, as a wake sets it (no seed). Each checkpoint would otherwise leave it ~25 ms behind. A
        failure is logged; the guest runs on with its clock behind."""
        channel = self._channel
        if channel is None or channel.closed:
            return
        try:
            await channel.call("vm.after_wake", {"time": time.time()}, timeout=10)
        except ChannelError as e:
            if not channel.closed:  # one closed meanwhile (a sleep, a stop) has no clock left to set
                log.warning("could not set the guest clock after a pause", sandbox=self.id, error=str(e))

    async def _disk_snapshot(self, tag: str) -> None:
        """The disk's qcow2 internal snapshot ``tag`` of a paused guest (one of that name replaced)."""
        assert self._qmp is not None
        try:
            await self._qmp.execute("blockdev-snapshot-delete-internal-sync", {"device": "disk", "name": tag})
        except QMPError:
            pass
        await self._qmp.execute("blockdev-snapshot-internal-sync", {"device": "disk", "name": tag})

    def _validate_snapshot(self, snap_dir: Path, record: dict[str, Any] | None) -> dict[str, Any]:
        if not record:
            raise SnapshotCorrupt(f"sandbox {self.id} has no snapshot record", hint="it cold-boots from its disk")
        if record.get("qemu") != qemu_version() or record.get("layout") != self._vm_config().layout_id():
            raise SnapshotIncompatible(
                f"snapshot of {self.id} was taken by {record.get('qemu')} with layout {record.get('layout')}; this host runs {qemu_version()} with layout {self._vm_config().layout_id()}",
                hint="it cold-boots from its disk; processes in memory are lost, files are kept",
            )
        dev = snap_dir / "dev.state"
        if not dev.exists() or ram.sha256_file(dev) != record.get("dev_sha256"):
            raise SnapshotCorrupt(f"device state of {self.id} is missing or fails its checksum", hint="it cold-boots from its disk")
        if record["kind"] == "delta":
            delta = snap_dir / "ram.delta"
            if not delta.exists() or not (snap_dir / "ram.idx").exists() or not ram.delta_matches(delta, record):
                raise SnapshotCorrupt(f"RAM delta of {self.id} is missing or fails its checksum", hint="it cold-boots from its disk")
        else:
            ram_file = snap_dir / "ram" if (snap_dir / "ram").exists() else self.dir / "ram"
            if not ram_file.exists() or not ram.digest_matches(ram_file, record.get("ram_checksum")):
                raise SnapshotCorrupt(f"RAM file of {self.id} is missing, truncated or changed", hint="it cold-boots from its disk")
        return record

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
            ph = _Phases()
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
        ph = _Phases()
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
        ph = _Phases()
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

    async def _restore(self, snap_dir: Path, record: dict[str, Any], launch: "asyncio.Task[None]", ph: _Phases,
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

    async def _run_restored(self, ph: _Phases, fresh_fork: bool, kind: str) -> None:
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

    async def _live_snapshot(self) -> None:
        """Write ``snapshot/`` of the paused guest, marked live (see ``frozen``)."""
        assert self._qmp is not None and self.pid is not None
        target = self.dir / "snapshot"
        new = target.with_name(target.name + ".new")
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        await self._qmp.save_device_state(new / "dev.state")
        record: dict[str, Any] = {"kind": self.ram_mode, "qemu": qemu_version(), "layout": self._vm_config().layout_id(),
                                  "image": self._meta["image_id"], "created_at": time.time(), "live": True}
        if self.ram_mode == "delta":
            m = ram.find_mapping(self.pid, self._ram_path())
            record["delta_bytes"] = await asyncio.to_thread(ram.save_delta, self.pid, m, self._ram_path(), new)
            record["delta_xxh3"] = ram.delta_digest(new / "ram.delta")
        else:
            record["ram_checksum"] = ram.file_digest(self.dir / "ram")
        record["dev_sha256"] = ram.sha256_file(new / "dev.state")
        _write_json(new / "snapshot.json", record)
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)

    async def checkpoint(self, name: str, *, durable: bool = True) -> CheckpointInfo:
        validate_id(name, "checkpoint name")
        async with self._lock:
            if self.state is not SandboxState.RUNNING or self._qmp is None:
                raise SandboxStateError(f"sandbox {self.id} is {self.state.value}; checkpoints are taken of a running sandbox", hint="call wake() first")
            cps = self.dir / "checkpoints"
            target = cps / name
            cps.mkdir(exist_ok=True)
            # RAM as the pages changed since the checkpoint this guest last passed (taken or rolled back to).
            # Taken again under the same name: a whole one (what built on the old one keeps it, ``set_aside``).
            tip = self._meta.get("ram_tip")
            base = cps / tip if tip and tip != name and (cps / tip / ram_chain.CHAIN).exists() else None
            await asyncio.to_thread(ram_chain.set_aside, cps, name)
            # The disk's state at the same instant, as a qcow2 internal snapshot taken in the same pause.
            info = await self._snapshot_to(target, keep_running=True, ram_base=base, disk_tag=f"ckpt-{name}",
                                           behind=not durable)
            # The next checkpoint's base (under this lock, so once the files are written; one that failed to be
            # written is then missing, and the next is a whole one).
            self._meta["ram_tip"] = name
            self._save_meta()
            return CheckpointInfo(name, self.id, target, info.bytes, info.created_at, True)

    async def rollback(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not (src / "snapshot.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            record = json.loads((src / "snapshot.json").read_text())
            # qemu-img opens the backing file the header names (as root): only the one the host gave this disk
            # (checked first here, before any work).
            microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
            # The memory image first, while the guest still runs: a checkpoint whose RAM cannot be put together
            # (a base's pages gone or changed) is refused here and leaves the sandbox as it was.
            staged = self.dir / "snapshot.rollback"
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir()
            try:
                shutil.copyfile(src / "dev.state", staged / "dev.state")
                if record["kind"] == "delta":
                    # The whole delta, put together from the pages of this checkpoint and those it builds on.
                    record.pop("delta_sha256", None)
                    record["delta_bytes"], record["delta_xxh3"] = await asyncio.to_thread(
                        ram_chain.materialize, src.parent, name, staged)
                _write_json(staged / "snapshot.json", record)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            await self._teardown()
            # Again now that its QEMU (which can write the header) is gone: this is the check qemu-img relies on.
            microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
            r = await asyncio.to_thread(subprocess.run, ["qemu-img", "snapshot", "-a", f"ckpt-{name}", str(self.dir / "disk.qcow2")],
                                        capture_output=True, text=True)
            if r.returncode != 0:
                raise SnapshotCorrupt(f"cannot restore the disk of checkpoint {name}: {r.stderr.strip()}")
            snap = self.dir / "snapshot"
            shutil.rmtree(snap, ignore_errors=True)
            os.rename(staged, snap)
            if record["kind"] != "delta":
                _sparse_copy(src / "ram", self.dir / "ram")
            self._meta["ram_mode"] = record["kind"]
            self._meta["ram_tip"] = name
            self._set_state(SandboxState.SLEEPING, snapshot=record)
            await self._wake_locked()

    async def delete_checkpoint(self, name: str) -> None:
        """Remove one checkpoint (retention): its RAM delta and device state, and the disk's internal snapshot,
        whose clusters qcow2 frees (a running QEMU deletes it itself, the image being locked by it)."""
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not (src / "snapshot.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            # Its record first: a crash mid-removal leaves no half checkpoint that lists or restores, only disk.
            (src / "snapshot.json").unlink()
            _fsync_dir(src)
            tag = f"ckpt-{name}"
            if self.state is SandboxState.RUNNING and self._qmp is not None:
                try:
                    await self._qmp.execute("blockdev-snapshot-delete-internal-sync", {"device": "disk", "name": tag})
                except QMPError as e:
                    log.warning("could not delete a checkpoint's disk snapshot", sandbox=self.id, error=str(e))
            else:
                # qemu-img opens the backing file the header names (as root): only the one the host gave this disk.
                microvm_user.check_backing(self.dir / "disk.qcow2", self.dir)
                r = await asyncio.to_thread(subprocess.run, ["qemu-img", "snapshot", "-d", tag,
                                                             str(self.dir / "disk.qcow2")], capture_output=True, text=True)
                if r.returncode != 0:
                    log.warning("could not delete a checkpoint's disk snapshot", sandbox=self.id, error=r.stderr.strip())
            # Its RAM goes unless a later checkpoint builds on it (then with the last of those).
            await asyncio.to_thread(ram_chain.collect, src.parent)

    async def checkpoints(self) -> list[CheckpointInfo]:
        await self._lock.caught_up()
        out = []
        base = self.dir / "checkpoints"
        if base.exists():
            for d in sorted(base.iterdir()):
                if (d / "snapshot.json").exists():
                    rec = json.loads((d / "snapshot.json").read_text())
                    out.append(CheckpointInfo(d.name, self.id, d, _allocated(d), rec["created_at"], True))
        return out

    async def destroy(self) -> None:
        async with self._lock:
            await self._teardown()
            tpl = self._meta.get("template_dir")
            if tpl:
                (Path(tpl) / "children" / self.id).unlink(missing_ok=True)
                _collect_template(Path(tpl))
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
        snapshot_bytes = _allocated(self.dir / "snapshot")
        if self.state is SandboxState.SLEEPING and self.ram_mode == "shared":
            snapshot_bytes += _allocated(self.dir / "ram")
        return SandboxStats(
            state=self.state,
            host_rss_bytes=rss,
            disk_bytes=_allocated(self.dir / "disk.qcow2"),
            snapshot_bytes=snapshot_bytes,
            checkpoint_bytes=_allocated(self.dir / "checkpoints"),
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
        if self._net is not None:  # QEMU keeps its tap; whoever re-attaches finds the namespace through it
            self._net.close()
            self._net = None


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
                # Probe with this driver's own image kernel (no second download); cached per host boot.
                img = self.image()
                self._accel = "kvm" if probe_kvm(self.config, kernel=img.kernel, initrd=img.initrd).usable else "tcg"
            else:
                self._accel = choose_accel(self.config)
        return self._accel

    def image(self) -> GuestImage:
        """The guest image for this configuration, built on first use (cached afterwards)."""
        return ImageBuilder(self.images_dir).build()

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / validate_id(sandbox_id)

    async def create(self, sandbox_id: str, spec: SandboxSpec | None = None, template: TemplateRef | None = None) -> MicroVMSandbox:
        if template is not None:
            return (await self.fork(template, [sandbox_id]))[0]
        spec = spec or SandboxSpec()
        d = self._dir(sandbox_id)
        if d.exists():
            raise ConflictError(f"sandbox {sandbox_id} already exists", hint="open() it or destroy() it first")
        img = await asyncio.to_thread(self.image)
        await asyncio.to_thread(lambda: self.accel)
        if spec.memory_mib < 128:
            raise InvalidInput(f"memory_mib={spec.memory_mib} is too small for the guest", hint="use at least 128")
        if spec.disk_mib < 1:
            raise InvalidInput(f"disk_mib={spec.disk_mib} leaves the agent no disk space", hint="use disk_mib >= 1")
        # Limits and environment reach the guest's init on the kernel command line (there is no other way in
        # before the channel is up, and it is part of the snapshot's layout, which forks share anyway).
        extra = f" moorage.nproc={spec.max_processes} moorage.fsize={spec.max_file_mib << 20} moorage.growfs"
        if spec.env:
            extra += " moorage.env=" + base64.urlsafe_b64encode(json.dumps(dict(spec.env)).encode()).decode()
        if len(extra) > 1024:
            raise InvalidInput("sandbox environment too large for a micro-VM (1 KiB encoded)", hint="pass large settings as a file instead")
        d.mkdir(parents=True)
        # The agent's disk: a copy-on-write overlay on the image's root filesystem (shrunk to its contents),
        # disk_mib larger; the guest grows the filesystem to fill it at boot. So disk_mib is the agent's own space,
        # and a guest can never make its disk hold more than image + disk_mib (+ qcow2 metadata) on the host.
        await _qemu_img("create", "-q", "-f", "qcow2", "-b", str(img.rootfs), "-F", "raw", str(d / "disk.qcow2"),
                        f"{img.disk_mib + spec.disk_mib}M", sandbox_dir=d)
        # A network agent's VM gets a NIC where this host can make a tap (else its relay is its network).
        nic = await asyncio.to_thread(microvm_net.wanted, spec.env)
        vm = VMConfig(memory_mib=spec.memory_mib, vcpus=spec.vcpus, accel=self.accel, kernel_cmdline=kernel_cmdline(img.cmdline + extra, self.accel), nic=nic)
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
        _write_json(d / "meta.json", meta)
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
        sb = MicroVMSandbox(self, sandbox_id, meta)
        if meta["state"] == SandboxState.RUNNING.value:
            if not await sb._reattach():
                # QEMU died with the host: no consistent memory image exists, the disk does.
                sb._set_state(SandboxState.STOPPED, pid=None, snapshot=None)
        elif meta.get("pid") and pid_is_ours(meta["pid"], str(sb.run_dir)):
            # A QEMU left over from a crash in the middle of sleep: its snapshot may be incomplete.
            kill_pid(meta["pid"])
            sb._meta["pid"] = None
            sb._save_meta()
        self._open[sandbox_id] = sb
        return sb

    async def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "meta.json").exists())

    # --- the fleet: what travels between hosts, and making a fetched copy this host's ------------------------

    #: A sandbox directory's sleeping state on any host. Sockets (run/), pids, logs and half-written snapshot
    #: directories (*.new, *.old) are this host's only.
    _PORTABLE = frozenset({"meta.json", "disk.qcow2", "ram", "snapshot", "checkpoints"})
    #: A template directory's state on any host. ``children/`` and ``deleted`` are this host's bookkeeping and the
    #: child overlay is remade against this host's path (``adopt_template``).
    _TEMPLATE_PORTABLE = frozenset({"template.json", "dev.state", "ram", "disk.qcow2"})

    #: Set by a fleet member: called with a template id when a fetched sandbox's template is not on this host;
    #: it brings the template into ``template_dir(id)`` (blocking) or raises.
    template_source: Callable[[str], Any] | None = None

    @classmethod
    def portable(cls, rel: str) -> bool:
        """Whether ``rel`` (a path in a sandbox's directory) travels with its snapshot to another host."""
        return rel.split("/", 1)[0] in cls._PORTABLE

    @classmethod
    def template_portable(cls, rel: str) -> bool:
        """Whether ``rel`` (a path in a template's directory) travels when the template is published."""
        return rel.split("/", 1)[0] in cls._TEMPLATE_PORTABLE

    def template_dir(self, template_id: str) -> Path:
        return self._templates_dir() / validate_id(template_id, "template id")

    @staticmethod
    def template_image_id(tdir: Path) -> str | None:
        """The guest image a template's disk and memory were made on (its disk is an overlay on that rootfs)."""
        return json.loads((Path(tdir) / "template.json").read_text()).get("image_id")

    @staticmethod
    def template_image_dir(tdir: Path) -> Path:
        return Path(json.loads((Path(tdir) / "template.json").read_text())["image_dir"])

    def adopt_template(self, staging: Path, final: Path, image: GuestImage) -> None:
        """A template fetched into ``staging`` (renamed to ``final`` by the caller) made this host's: its disk
        backed by ``image`` (the same bytes as where it was made, checked by the caller), its metadata naming this
        host's image, and a child overlay for forks on ``final``'s disk. Blocking."""
        tmeta = json.loads((staging / "template.json").read_text())
        if tmeta.get("image_id") != image.id:
            raise SnapshotIncompatible(f"template {tmeta.get('id')} was made on image {tmeta.get('image_id')}, not {image.id}",
                                       hint="publish the template's own image with it")
        old = _qcow2_backing(staging / "disk.qcow2")
        if old is None or Path(old).name != image.rootfs.name:
            # A template made from a fork's snapshot would chain onto another template: not a publishable one.
            raise SnapshotIncompatible(f"template {tmeta.get('id')} disk is not an overlay on its image ({old})",
                                       hint="publish templates made from a sandbox booted from the image")
        _rebase(staging / "disk.qcow2", image.rootfs, "raw")
        child = staging / CHILD_DISK
        r = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(staging / "disk.qcow2"), "-F", "qcow2",
                            str(child)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SandboxError(f"qemu-img create of a child overlay failed: {r.stderr.strip()}")
        _rebase(child, final / "disk.qcow2", "qcow2")
        (staging / "children").mkdir(exist_ok=True)
        tmeta["image_dir"] = str(image.dir)
        _write_json(staging / "template.json", tmeta)

    def adopt_fetched(self, sandbox_id: str) -> None:
        """A sandbox fetched from another host (asleep, or copied while it ran there, see ``frozen``): its metadata
        and disk now name this host's template (fetched through ``template_source`` when missing) and image, and no
        process of the other host. Idempotent."""
        d = self._dir(sandbox_id)
        meta = json.loads((d / "meta.json").read_text())
        tid = meta.get("template_id")
        if tid:
            tdir = self.template_dir(tid)
            why = "no template source is set"
            if not (tdir / "template.json").exists() and self.template_source is not None:
                try:
                    self.template_source(tid)
                except SandboxError:
                    raise
                except Exception as e:  # not published (a fork template), or the object store failed
                    why = str(e)
            try:
                tmeta = json.loads((tdir / "template.json").read_text())
            except FileNotFoundError as e:
                raise SnapshotCorrupt(f"sandbox {sandbox_id} was forked from template {tid}, which is not on this "
                                      f"host and could not be fetched: {why}",
                                      hint="only deployment templates are published to the object store; forks of "
                                           "other templates wake on the host that made them") from e
            if tmeta.get("image_id") != meta.get("image_id"):
                raise SnapshotIncompatible(f"template {tid} here is on image {tmeta.get('image_id')}, sandbox "
                                           f"{sandbox_id} on {meta.get('image_id')}")
            if meta.get("template_dir") is not None:
                meta["template_dir"] = str(tdir)
            meta["image_dir"] = tmeta["image_dir"]
            (tdir / "children").mkdir(exist_ok=True)
            (tdir / "children" / sandbox_id).write_text("")  # keeps a deleted template's files while it lives here
            _rebase(d / "disk.qcow2", tdir / "disk.qcow2", "qcow2")
        else:
            # Booted from the image itself: its disk is an overlay on this host's copy of the image by id.
            img_dir = self.images_dir / str(meta.get("image_id"))
            if not (img_dir / "manifest.json").exists():
                raise SnapshotIncompatible(f"sandbox {sandbox_id} needs guest image {meta.get('image_id')}, not on this host",
                                           hint="build the same image on this host (`moorage image build`)")
            img = GuestImage.load(img_dir)
            meta["image_dir"] = str(img.dir)
            _rebase(d / "disk.qcow2", img.rootfs, "raw")
        if meta.get("state") == SandboxState.RUNNING.value:
            # Shipped while it ran (``frozen``): its memory image of that instant, if the copy has one, is this
            # copy's snapshot; otherwise it boots from the disk it was shipped with.
            try:
                live = json.loads((d / "snapshot" / "snapshot.json").read_text())
            except (OSError, ValueError):
                live = None
            if isinstance(live, dict) and live.get("live"):
                meta.update(state=SandboxState.SLEEPING.value, snapshot=live, fresh_fork=False)
            else:
                meta.update(state=SandboxState.STOPPED.value, snapshot=None)
        meta["pid"] = None
        _write_json(d / "meta.json", meta)
        self._open.pop(sandbox_id, None)

    # --- templates and forks --------------------------------------------------------------------------------

    def _templates_dir(self) -> Path:
        return self.root / _TEMPLATES

    async def make_template(self, sandbox: Sandbox, template_id: str | None = None) -> TemplateRef:
        if not isinstance(sandbox, MicroVMSandbox):
            raise InvalidInput("make_template needs a sandbox of the microvm driver")
        tid = validate_id(template_id or f"tpl-{sandbox.id}-{int(time.time())}", "template id")
        tdir = self._templates_dir() / tid
        if tdir.exists():
            raise ConflictError(f"template {tid} already exists", hint="delete_template() it first or pick another id")
        async with sandbox._lock:
            if sandbox.state is not SandboxState.RUNNING or sandbox._qmp is None or sandbox.pid is None:
                raise SandboxStateError(f"sandbox {sandbox.id} must be running to become a template", hint="wake() it first")
            # Flush the guest's dirty pages so the template's disk alone holds every file (a fork whose snapshot
            # is unusable cold-boots from it), and drop its page cache: measured here, forks of a template with
            # its cache dropped answer their first call after a wake ~20 ms sooner (wake p50 ~90 vs ~110 ms).
            try:
                await sandbox.exec(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], timeout=30)
            except ChannelError as e:
                log.warning("guest sync before template failed", sandbox=sandbox.id, error=str(e))
            tmp = tdir.with_name(tid + ".new")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "children").mkdir()
            qmp = sandbox._qmp
            await qmp.execute("stop")
            try:
                await qmp.save_device_state(tmp / "dev.state")
                m = ram.find_mapping(sandbox.pid, sandbox._ram_path())
                await asyncio.to_thread(ram.read_all, sandbox.pid, m, tmp / "ram")
                # Root's alone from the start on a root host (forks map a sealed copy, microvm_memfd); an
                # unprivileged host's QEMU maps the file itself and opens it read-write.
                os.chmod(tmp / "ram", 0o400 if os.geteuid() == 0 else 0o600)
                await asyncio.to_thread(shutil.copyfile, sandbox.dir / "disk.qcow2", tmp / "disk.qcow2")
                # Its QEMU can write the disk's header: a template (root's, shared) never inherits a backing file
                # other than the one the host gave the sandbox.
                microvm_user.check_backing(tmp / "disk.qcow2", sandbox.dir)
            finally:
                await qmp.execute("cont")
            # Internal snapshots (checkpoints) of the source are not part of the template.
            subprocess.run(["qemu-img", "snapshot", "-l", str(tmp / "disk.qcow2")], capture_output=True)
            ram.fsync_path(tmp / "disk.qcow2")
            ram.fsync_path(tmp / "dev.state")
            (tmp / "disk.qcow2").chmod(0o444)
            meta = {
                "id": tid,
                "source_sandbox": sandbox.id,
                "image_id": sandbox._meta["image_id"],
                "image_dir": sandbox._meta["image_dir"],
                "vm": sandbox._meta["vm"],
                "spec": sandbox._meta["spec"],
                "snapshot": {
                    "kind": "delta",
                    "qemu": qemu_version(),
                    "layout": sandbox._vm_config().layout_id(),
                    "image": sandbox._meta["image_id"],
                    "dev_sha256": ram.sha256_file(tmp / "dev.state"),
                    "created_at": time.time(),
                },
                "created_at": time.time(),
            }
            _write_json(tmp / "template.json", meta)
            os.rename(tmp, tdir)
            _fsync_dir(tdir.parent)
        # The empty overlay every fork's disk starts as (its backing path is the template's final place). Forks
        # made before it exists, or if this fails, create their overlay themselves.
        try:
            await _qemu_img("create", "-q", "-f", "qcow2", "-b", str(tdir / "disk.qcow2"), "-F", "qcow2",
                            str(tdir / (CHILD_DISK + ".new")))
            ram.fsync_path(tdir / (CHILD_DISK + ".new"))
            os.rename(tdir / (CHILD_DISK + ".new"), tdir / CHILD_DISK)
        except SandboxError as e:
            log.warning("no child overlay for template; forks create theirs", template=tid, error=str(e))
        log.info("template made", template=tid, source=sandbox.id)
        return TemplateRef(id=tid, driver=self.name, path=tdir, source_sandbox=sandbox.id, created_at=meta["created_at"], includes_memory=True)

    async def delete_template(self, template: TemplateRef) -> None:
        """No new forks from it; its files go when the last fork that maps its RAM and disk is destroyed."""
        tdir = Path(template.path)
        if not (tdir / "template.json").exists():
            return
        (tdir / "deleted").write_text(str(time.time()))
        _collect_template(tdir)

    async def fork(self, template: TemplateRef, ids: Sequence[str]) -> list[MicroVMSandbox]:
        if template.driver != self.name:
            raise SnapshotIncompatible(f"template {template.id} was made by the {template.driver} driver", hint="fork it with that driver, or make a template with the microvm driver")
        tdir = Path(template.path)
        try:
            tmeta = json.loads((tdir / "template.json").read_text())
        except FileNotFoundError as e:
            raise SandboxNotFound(f"template {template.id} not found at {tdir}") from e
        if (tdir / "deleted").exists():
            raise SandboxNotFound(f"template {template.id} was deleted", hint="make a new template")
        if tmeta.get("snapshot", {}).get("qemu") != qemu_version():
            raise SnapshotIncompatible(f"template {template.id} was made with {tmeta.get('snapshot', {}).get('qemu')}, this host runs {qemu_version()}", hint="make the template again on this host")
        for sid in ids:
            if self._dir(sid).exists():
                raise ConflictError(f"sandbox {sid} already exists", hint="pick another id or destroy it first")
        if len(set(ids)) != len(ids):
            raise InvalidInput("fork ids must be distinct")

        async def one(sid: str) -> MicroVMSandbox:
            d = self._dir(sid)
            (d / "snapshot").mkdir(parents=True)
            if (tdir / CHILD_DISK).exists():
                # Every child's disk starts as the same empty overlay on the template's disk: copy it (no process).
                await asyncio.to_thread(shutil.copyfile, tdir / CHILD_DISK, d / "disk.qcow2")
            else:  # a template made before child overlays were kept
                await _qemu_img("create", "-q", "-f", "qcow2", "-b", str(tdir / "disk.qcow2"), "-F", "qcow2",
                                str(d / "disk.qcow2"), sandbox_dir=d)
            # A fresh fork's snapshot is the template's device state with an empty RAM delta.
            shutil.copyfile(tdir / "dev.state", d / "snapshot" / "dev.state")
            (d / "snapshot" / "ram.delta").write_bytes(b"")
            (d / "snapshot" / "ram.idx").write_bytes(b"")
            record = dict(tmeta["snapshot"], delta_bytes=0, delta_xxh3=ram.delta_digest(d / "snapshot" / "ram.delta"))
            _write_json(d / "snapshot" / "snapshot.json", record)
            (tdir / "children" / sid).write_text("")
            meta = {
                "id": sid,
                "driver": self.name,
                "spec": tmeta["spec"],
                "image_id": tmeta["image_id"],
                "image_dir": tmeta["image_dir"],
                "vm": tmeta["vm"],
                "ram_mode": "delta",
                "template_dir": str(tdir),
                "template_id": tmeta["id"],
                "state": SandboxState.SLEEPING.value,
                "pid": None,
                "snapshot": record,
                "fresh_fork": True,
                "created_at": time.time(),
            }
            _write_json(d / "meta.json", meta)
            sb = MicroVMSandbox(self, sid, meta)
            self._open[sid] = sb
            return sb

        return list(await asyncio.gather(*(one(validate_id(s)) for s in ids)))

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
