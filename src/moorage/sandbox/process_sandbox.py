"""A process sandbox (process.py's driver makes and opens them): the guest supervisor in bubblewrap namespaces on
the host kernel, under an unprivileged uid on a root host, in a cgroup of its own; its start, sleep (the files only),
disk quota watchdog, checkpoints (process_checkpoints.py) and rollback (in place through its zygote where it can:
process_restart.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from moorage.errors import ConflictError
from moorage.log import get_logger
from moorage.sandbox import capped_log, process_checkpoints, process_net, process_restart, process_seccomp, process_templates
from moorage.sandbox import process_limits as limits
from moorage.sandbox.base import (
    ChannelError,
    CheckpointInfo,
    GuestProtocolError,
    RemoteError,
    Sandbox,
    SandboxError,
    SandboxNotFound,
    SandboxSpec,
    SandboxState,
    SandboxStateError,
    SandboxStats,
    SnapshotCorrupt,
    SnapshotInfo,
    validate_id,
)
from moorage.sandbox.channel import Channel
from moorage.sandbox.process_fs import copy_tree, disk_usage, proc_starttime, write_json_durable

if TYPE_CHECKING:
    from moorage.sandbox.process import ProcessDriver

log = get_logger(__name__)


META_VERSION = 1
SOCKET_NAME = "chan.sock"
GUEST_MOUNT = "/opt/moorage/guest"
GUEST_UID = 1000
SUPERVISOR_PYTHON = "/usr/bin/python3"
#: Host /etc files a Debian userland needs; the rest of /etc (shadow, keys, host config) stays invisible.
ETC_ALLOWLIST = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl/certs", "ca-certificates",
    "ca-certificates.conf", "python3", "python3.11", "localtime", "nsswitch.conf", "mime.types", "protocols",
    "services", "debian_version", "os-release",
)
_START_TIMEOUT_S = 30.0
#: supervisor.log (the sandbox's stdout and stderr) up to this size, then rotated to supervisor.log.1.
SUPERVISOR_LOG_CAP_BYTES = 512 << 10
#: Where a root host's launcher binds the sandbox's own directories in its private mount namespace, so the
#: unprivileged sandbox uid never needs to traverse the data directory's parents (e.g. /root, mode 0700).
STAGE = "/tmp"
_STOP_TIMEOUT_S = 5.0

_tasks: set[asyncio.Task] = set()


def _background(coro: Any, name: str) -> None:
    """Run ``coro`` without awaiting it, keeping a reference until it ends (the loop only holds weak ones)."""
    t = asyncio.get_running_loop().create_task(coro, name=name)
    _tasks.add(t)
    t.add_done_callback(_tasks.discard)


def _is_guest(pid: int) -> bool:
    """Whether ``pid`` runs the guest package (the zygote or a supervisor; bwrap's own argv names it too)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[0] == SUPERVISOR_PYTHON.encode() and GUEST_MOUNT.encode() in argv


class ProcessSandbox(Sandbox):
    def __init__(self, driver: "ProcessDriver", sandbox_id: str, meta: dict[str, Any]) -> None:
        self.driver = driver
        self.id = sandbox_id
        self.dir = driver.root / sandbox_id
        #: The data directory's sandboxes this one's processes are started under (recorded with their pid).
        self._root_key = str(Path(driver.root).resolve())
        self.meta = meta
        self.spec = SandboxSpec.from_json(meta.get("spec", {}))
        self._state = SandboxState(meta["state"])
        self._channel: Channel | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = meta.get("pid")
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
        #: The host's end of the zygote's control socket (process_restart), while the sandbox runs.
        self._zygote: Any = None
        #: A network agent's DNS address in the sandbox's namespace, bound by the host (process_net), while it runs.
        self._dns: process_net.SandboxDNS | None = None
        #: The thread copying the sandbox's output into supervisor.log (capped_log), since its last start.
        self._log_reader: threading.Thread | None = None
        self.cgroup = limits.SandboxCgroup(driver.limit_support, f"{driver.instance_tag}-{sandbox_id}")
        #: Set when the disk quota watchdog killed the sandbox's processes (cleared on the next start).
        self.quota_exceeded = False

    # --- paths -----------------------------------------------------------------------------------------------

    @property
    def layer(self) -> Path:
        return self.dir / "layer"

    @property
    def socket_path(self) -> Path:
        return self.dir / "run" / SOCKET_NAME

    def sources(self) -> dict[str, Path]:
        """The host directories bound into the sandbox, by name (a root host's launcher binds each under ``STAGE``
        by that name): its layer, run and etc directories, the guest package, then ``shared<i>``, the template's
        shared directories in the order of ``shared_targets``."""
        out = {"layer": self.layer, "run": self.dir / "run", "etc": self.dir / "etc", "guest": self.driver._guest_dir}
        for i, (host, _) in enumerate(process_templates.binds(self.meta, self.driver.template_dir)):
            out[f"shared{i}"] = host
        return out

    def shared_targets(self) -> list[tuple[str, str]]:
        """(source name, sandbox path) of each shared directory, bound read-only over the layer's mount point."""
        paths = (self.meta.get("shared") or {}).get("paths") or []
        return [(f"shared{i}", process_templates.sandbox_path(rel)) for i, rel in enumerate(paths)]

    # --- state -----------------------------------------------------------------------------------------------

    @property
    def state(self) -> SandboxState:
        if self._state is SandboxState.RUNNING and not self._alive():
            # The supervisor died under us (OOM, crash, killed): the layer is intact, memory is gone.
            self._state = SandboxState.STOPPED
        return self._state

    @property
    def channel(self) -> Channel:
        if self.state is not SandboxState.RUNNING or self._channel is None or self._channel.closed:
            raise SandboxStateError(
                f"sandbox {self.id} is {self.state.value}, not running",
                hint="call wake() (sleeping/stopped) or start() (created) first",
            )
        return self._channel

    def _alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        if self._pid is None:
            return False
        if self.meta.get("started_under", self._root_key) != self._root_key:
            # Started by a host on another data directory, of which this is a copy (docs/operations.md): that
            # process is the original's sandbox, never this one, even while it runs.
            return False
        return proc_starttime(self._pid) == self.meta.get("pid_starttime")

    def _save(self, **changes: Any) -> None:
        self.meta.update(changes)
        self.meta["state"] = self._state.value
        write_json_durable(self.dir / "meta.json", self.meta)

    def _require(self, *allowed: SandboxState, verb: str) -> None:
        st = self.state
        if st not in allowed:
            hints = {
                SandboxState.CREATED: "call start() first",
                SandboxState.SLEEPING: "call wake() first",
                SandboxState.STOPPED: "call wake() or start() first",
                SandboxState.RUNNING: "call sleep() or stop() first",
                SandboxState.DESTROYED: "create a new sandbox",
            }
            raise SandboxStateError(f"cannot {verb} sandbox {self.id}: it is {st.value}", hint=hints.get(st))

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            self._require(SandboxState.CREATED, SandboxState.STOPPED, SandboxState.SLEEPING, verb="start")
            await self._boot()

    async def wake(self) -> None:
        async with self._lock:
            self._require(SandboxState.SLEEPING, SandboxState.STOPPED, verb="wake")
            await self._boot()

    async def _boot(self) -> None:
        spec = self.spec
        self.quota_exceeded = False
        self._sweep_layer_leftovers()
        self._drop_dns()  # a sandbox that died on its own left its last start's sockets (in a namespace now gone)
        run = self.dir / "run"
        run.mkdir(mode=0o700, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        uid = self.driver.host_uid
        if uid is not None:
            _own_tree(self.layer, uid)
            os.chown(run, uid, uid)
            os.chmod(run, 0o700)
        mem = spec.memory_mib << 20
        self.cgroup.create(spec.max_processes, mem, cpus=spec.vcpus)
        # Per-process address space: the only memory bound without a cgroup; with one (which bounds what is really
        # used) only a backstop, far enough above it that reserved-but-unused address space (thread stacks, malloc
        # arenas: 8 + 64 MiB a thread) never fails a thread the memory would allow.
        address_space = max(8 * mem, 4 << 30) if self.cgroup.bounds_memory_and_processes else mem
        staged = uid is not None
        # Above fd 9: the staging shell uses 3-6 for the directories it binds.
        seccomp_fd = process_seccomp.filter_fd(min_fd=10)
        zygote, zygote_fd = process_restart.control_pair(min_fd=10)
        try:
            argv = _with_seccomp(self.driver.bwrap_argv(self, staged=staged, zygote_fd=zygote_fd), seccomp_fd)
            # A uid shared by every sandbox counts its processes host-wide: the cgroup bounds each sandbox instead.
            nproc = spec.max_processes if not (staged and self.cgroup.bounds_memory_and_processes) else None
            prlimit = limits.rlimit_args(
                max_processes=nproc, max_file_bytes=spec.max_file_mib << 20, address_space_bytes=address_space
            )
            launch = [*prlimit, *argv]
            if staged:
                # As root: bind the sandbox's directories into a private mount namespace, then drop to the sandbox
                # uid (no capabilities, no groups) before bubblewrap runs; bubblewrap then needs no privilege.
                launch = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                          _stage_script(self.sources()), "moorage-stage", *prlimit,
                          "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                          "--bounding-set=-all", "--", *argv]
            # A tiny shell moves itself into the cgroup before exec'ing the rest, so no sandbox process ever runs
            # outside it.
            join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 111; shift; done; shift; exec "$@"'
            wrapper = ["/bin/sh", "-c", join, "moorage-sandbox", *map(str, self.cgroup.procs_files), "--", *launch]
            # The sandbox's output reaches supervisor.log through a pipe the host drains with a cap.
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            try:
                self._proc = subprocess.Popen(
                    wrapper, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, close_fds=True, pass_fds=[seccomp_fd, zygote_fd],
                    start_new_session=True,
                )
            except BaseException:
                os.close(out_r)
                raise
            finally:
                os.close(out_w)
            proc = self._proc
            self._log_reader = capped_log.start(out_r, self.dir / "supervisor.log", alive=lambda: proc.poll() is None,
                                                cap=SUPERVISOR_LOG_CAP_BYTES, name=f"log-{self.id}")
        except BaseException:
            zygote.close()
            raise
        finally:
            os.close(seccomp_fd)
            os.close(zygote_fd)
        self._zygote = zygote
        self._pid = self._proc.pid
        try:
            self._channel = await self._connect(_START_TIMEOUT_S)
            self._serve_dns()
        except BaseException:
            await self._kill()
            raise
        self._state = SandboxState.RUNNING
        self._save(pid=self._pid, pid_starttime=proc_starttime(self._pid), started_under=self._root_key,
                   boot_count=self.meta.get("boot_count", 0) + 1)
        self._start_watchdog()
        log.info("sandbox started", sandbox=self.id, pid=self._pid)

    def _sweep_layer_leftovers(self) -> None:
        """Remove what a rollback interrupted by a host stop left: its half-made copy or the layer it replaced
        (both hidden names; the layer itself is always whole), and checkpoints whose removal it interrupted. Runs under the sandbox's lock, so no rollback is
        making one now; a removal still running from the last rollback is harmless to repeat."""
        for d in self.dir.iterdir():
            if d.name.startswith((".layer-rollback-", ".layer-old-")) and d.is_dir():
                _background(asyncio.to_thread(shutil.rmtree, d, True), f"rm-layer-{self.id}")
        cks = self.dir / "checkpoints"
        for d in cks.glob(".*.deleting-*") if cks.is_dir() else ():
            _background(asyncio.to_thread(shutil.rmtree, d, True), f"rm-checkpoint-{self.id}")

    async def _connect(self, timeout: float) -> Channel:
        deadline = time.monotonic() + timeout
        last_error = "no socket yet"
        # The supervisor listens some 50-100 ms after the start (Python and asyncio imports): polled at 2 ms,
        # then less often, so a boot (and a rollback, which is one) is not rounded up to the next 20 ms.
        delay = 0.002
        while time.monotonic() < deadline:
            if not self._alive():
                await asyncio.to_thread(capped_log.settled, self._log_reader)
                tail = _tail(self.dir / "supervisor.log")
                raise SandboxError(f"sandbox {self.id} exited while starting", hint=f"supervisor log: {tail}")
            if self.socket_path.exists():
                try:
                    ch = await Channel.open_unix(str(self.socket_path), name=f"sandbox:{self.id}",
                                                 max_guest_inflight=self.driver.config.guest_calls_per_channel)
                except ChannelError as e:
                    last_error = str(e)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.02)
                    continue
                try:
                    await ch.call("ping", timeout=10)
                    return ch
                except (GuestProtocolError, RemoteError) as e:
                    # Something answered, but not our supervisor speaking the protocol: do not keep trying.
                    await ch.close()
                    raise SandboxError(f"sandbox {self.id} broke the channel protocol: {e}",
                                       hint="the guest may be compromised; destroy it or roll it back") from e
                except ChannelError as e:
                    await ch.close()
                    last_error = str(e)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.02)
        raise SandboxError(f"sandbox {self.id} did not answer within {timeout:g}s ({last_error})", hint="see supervisor.log")

    def _start_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._quota_watchdog(), name=f"quota-{self.id}")
        channel = self._channel
        if channel is not None:
            channel.on_protocol_error = lambda: self._protocol_broken(channel)

    def _protocol_broken(self, channel: Channel) -> None:
        """A guest that broke the channel protocol is stopped at once (its disk kept), not trusted with a
        reconnect: killed and marked stopped before any other task sees it running; the next turn starts it
        afresh. Reaping and cgroup removal follow under the lock."""
        if self._channel is not channel or self._state is not SandboxState.RUNNING:
            return
        log.warning("guest broke the channel protocol; stopping it", sandbox=self.id, error=str(channel.protocol_error))
        if self._pid is not None:
            victims = limits.descendants(self._pid)
            try:
                os.killpg(self._pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            limits.kill_pids(victims)
        self._state = SandboxState.STOPPED
        self._save(pid=None, pid_starttime=None)
        asyncio.get_running_loop().create_task(self._reap_after_protocol_error(channel), name=f"reap-{self.id}")

    async def _reap_after_protocol_error(self, channel: Channel) -> None:
        async with self._lock:
            if self._channel is channel:  # not restarted meanwhile
                await self._kill()

    async def _quota_watchdog(self) -> None:
        """Disk quota check: a layer grown past ``disk_mib`` gets every process but the supervisor killed.

        There is no block-level quota on a plain directory, so this polls; the poll interval adapts to the cost
        of a scan so large layers do not burn CPU. RLIMIT_FSIZE bounds any single file in between.
        """
        quota = self.spec.disk_mib << 20
        loop = asyncio.get_running_loop()
        last = 0
        strikes = orphan_growth = 0
        try:
            while self._state is SandboxState.RUNNING and self._alive():
                t0 = time.monotonic()
                used = await loop.run_in_executor(None, disk_usage, self.layer)
                cost = time.monotonic() - t0
                # Kill only while usage grows past the quota, so removing files (even with rm) stays possible.
                if used > quota and used > last:
                    self.quota_exceeded = True
                    victims = self._guest_workers()
                    strikes += 1
                    orphan_growth = 0 if victims else orphan_growth + 1
                    if orphan_growth > 1 or strikes > 3:
                        # Still growing with no worker left to blame: the writer is the supervisor itself (agent
                        # code runs there). The whole sandbox stops; its disk stays as it is.
                        log.warning("disk quota exceeded by the supervisor; stopping the sandbox", sandbox=self.id,
                                    used=used, quota=quota)
                        loop.create_task(self._stop_over_quota())
                        return
                    limits.kill_pids(victims)
                    log.warning("disk quota exceeded; killed sandbox processes", sandbox=self.id, used=used, quota=quota,
                                killed=len(victims))
                else:
                    strikes = orphan_growth = 0
                last = used
                # Past half the quota the checks come ten times as often: a writer on a fast disk moves hundreds
                # of MiB between two checks 0.2 s apart, and the overshoot is what it writes between them.
                floor = 0.02 if used > quota // 2 else 0.2
                await asyncio.sleep(min(max(cost * 20, floor), 5.0))
        except asyncio.CancelledError:
            pass

    async def _stop_over_quota(self) -> None:
        async with self._lock:
            if self._state is SandboxState.RUNNING:
                # Stopped before the kill: the turn it fails ends when the kill closes the channel, and the next
                # turn must find a stopped sandbox to restart (after this lock), not a running one being killed.
                self._state = SandboxState.STOPPED
                await self._kill()
                self._save(pid=None, pid_starttime=None)

    def _guest_workers(self) -> list[int]:
        """Host pids of everything the supervisor started (its descendants), not bwrap and not the supervisor."""
        if self._pid is None:
            return []
        for pid in limits.descendants(self._pid):
            if _is_guest(pid):
                # The first guest process is the zygote; the supervisor is its guest child (none while a
                # rollback restarts it).
                sup = next((c for c in limits.descendants(pid) if _is_guest(c)), None)
                return limits.descendants(sup) if sup is not None else []
        return []

    async def _let_go(self) -> None:
        """Stop watching the guest and drop the channel to it (its processes are the caller's to end)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _serve_dns(self) -> None:
        """A network agent's sandbox: its DNS address bound (once per start) and offered with the new channel
        (``runtime/vm_network`` serves it when it attaches the agent's network)."""
        if not process_net.wanted(self.spec.env) or self._pid is None:
            return
        try:
            if self._dns is None:
                root = self._pid
                inside = next((p for p in limits.descendants(root) if _is_guest(p)), None)
                self._dns = None if inside is None else \
                    process_net.bind(inside, still_ours=lambda: inside in limits.descendants(root))
            process_net.bind_channel(self._channel, self._dns)
        except Exception as e:  # noqa: BLE001 - a sandbox without its DNS still starts (its tools use the proxy)
            log.warning("sandbox DNS not bound", sandbox=self.id, error=str(e)[:200])

    def _drop_dns(self) -> None:
        if self._dns is not None:
            self._dns.close()
            self._dns = None

    async def _kill(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        self._drop_dns()
        await self._let_go()
        if self._pid is not None and self._alive():
            try:
                os.killpg(self._pid, 9)  # the wrapper started a session: its group is the whole sandbox tree
            except (ProcessLookupError, PermissionError):
                pass
        limits.kill_pids(limits.descendants(self._pid) if self._pid else [])
        if self._proc is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, _STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("sandbox process did not exit after SIGKILL", sandbox=self.id, pid=self._pid)
        else:
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            while self._alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.cgroup.remove()
        self._proc = None

    async def _shutdown(self) -> None:
        """Flush the guest's files, ask the supervisor to exit, then make sure nothing is left running."""
        if self._channel is not None and not self._channel.closed and self._alive():
            try:
                await self._channel.call("sys.sync", timeout=30)
                await self._channel.call("sys.shutdown", timeout=5)
            except ChannelError as e:
                log.warning("guest did not shut down cleanly; killing", sandbox=self.id, error=str(e))
        await self._kill()

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[None]:
        """SIGSTOP the whole sandbox tree (its wrapper started a session: one process group) for the block."""
        async with self._lock:
            self._require(SandboxState.RUNNING, verb="freeze")
            os.killpg(self._pid, signal.SIGSTOP)
            try:
                yield
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._pid, signal.SIGCONT)

    async def sleep(self) -> SnapshotInfo:
        async with self._lock:
            self._require(SandboxState.RUNNING, verb="sleep")
            await self._shutdown()
            self._state = SandboxState.SLEEPING
            self._save(pid=None, pid_starttime=None, slept_at=time.time())
            used = disk_usage(self.layer)
            log.info("sandbox slept", sandbox=self.id, disk_bytes=used)
            return SnapshotInfo(self.id, self.layer, used, time.time(), includes_memory=False)

    async def stop(self) -> None:
        async with self._lock:
            if self.state is SandboxState.DESTROYED:
                raise SandboxStateError(f"sandbox {self.id} is destroyed")
            await self._shutdown()
            if self._state is not SandboxState.CREATED:
                self._state = SandboxState.STOPPED
            self._save(pid=None, pid_starttime=None)

    async def checkpoint(self, name: str, *, durable: bool = True) -> CheckpointInfo:  # always written first
        validate_id(name, "checkpoint name")
        async with self._lock:
            self._require(SandboxState.RUNNING, SandboxState.SLEEPING, SandboxState.STOPPED, SandboxState.CREATED,
                          verb="checkpoint")
            if self._state is SandboxState.RUNNING:
                await self.channel.call("sys.sync", timeout=30)
            dest = self.dir / "checkpoints" / name
            if dest.exists():
                raise ConflictError(f"checkpoint {name!r} already exists in sandbox {self.id}",
                                    hint="pick another name or roll back to it")
            # All of it off the event loop (the host's one loop serves every tenant): the copy and the fsyncs.
            return await asyncio.to_thread(process_checkpoints.take, self.dir, self.id, name)

    async def checkpoints(self) -> list[CheckpointInfo]:
        """Each checkpoint's bytes are what it added to the older ones (files it shares with an older checkpoint
        count there), so their sum is the disk all of them take."""
        return await asyncio.to_thread(process_checkpoints.listing, self.dir, self.id)

    async def delete_checkpoint(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            src = self.dir / "checkpoints" / name
            if not src.exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            # Renamed aside first: a crash mid-removal never leaves a half checkpoint under its name.
            gone = self.dir / "checkpoints" / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
            os.rename(src, gone)
        await asyncio.to_thread(shutil.rmtree, gone, True)  # no longer a checkpoint: removed outside the lock

    async def rollback(self, name: str) -> None:
        validate_id(name, "checkpoint name")
        async with self._lock:
            self._require(SandboxState.RUNNING, SandboxState.SLEEPING, SandboxState.STOPPED, SandboxState.CREATED,
                          verb="roll back")
            src = self.dir / "checkpoints" / name
            if not (src / "checkpoint.json").exists():
                raise SandboxNotFound(f"sandbox {self.id} has no checkpoint {name!r}", hint="list them with checkpoints()")
            if not (src / "layer").is_dir():
                raise SnapshotCorrupt(f"checkpoint {name!r} of sandbox {self.id} has no layer directory")
            was_running = self._state is SandboxState.RUNNING
            if was_running and self._zygote is not None and self._alive():
                try:
                    await self._rollback_in_place(src)
                    return
                except process_restart.ZygoteGone as e:
                    log.warning("restart in place failed; restarting the sandbox", sandbox=self.id, error=str(e))
            # Swap in a copy so the checkpoint itself stays reusable; the old layer is removed only after the swap.
            # The copy is made while the processes are killed (processes and memory are not part of a
            # process-driver checkpoint): the checkpoint does not change, and nothing uses the copy until the swap.
            fresh = self.dir / f".layer-rollback-{uuid.uuid4().hex[:8]}"
            copied, killed = await asyncio.gather(copy_tree(src / "layer", fresh),
                                                  self._kill() if was_running else asyncio.sleep(0),
                                                  return_exceptions=True)
            for err in (killed, copied):
                if isinstance(err, BaseException):
                    shutil.rmtree(fresh, ignore_errors=True)
                    raise err
            await asyncio.to_thread(self._mount_points, fresh)
            old = self.dir / f".layer-old-{uuid.uuid4().hex[:8]}"
            os.rename(self.layer, old)
            os.rename(fresh, self.layer)
            try:
                if was_running:
                    await self._boot()
                else:
                    self._save()
            finally:
                # Not on the rollback's path: a layer with installed packages is thousands of files. A host that
                # stops before this is done leaves the directory to the next boot's sweep (_sweep_layer_leftovers).
                _background(asyncio.to_thread(shutil.rmtree, old, True), f"rm-layer-{self.id}")

    def _mount_points(self, layer: Path) -> None:
        """A checkpoint's copy of the layer made ready for the shared directories the sandbox binds now: one taken
        before it bound them (a redeploy changed its packages since) has no mount point there, or files of its
        own. Blocking."""
        for rel in (self.meta.get("shared") or {}).get("paths") or []:
            process_templates.mount_point(layer, rel)

    async def _rollback_in_place(self, src: Path) -> None:
        """Rollback of a running sandbox through its zygote (process_restart): the agent's processes are killed
        while the checkpoint's layer is copied, the copy's files are moved into the layer the sandbox has bound,
        and the zygote forks a fresh supervisor. The sandbox itself (bubblewrap, its namespaces) stays."""
        await self._let_go()
        fresh = self.dir / f".layer-rollback-{uuid.uuid4().hex[:8]}"
        trash = self.dir / f".layer-old-{uuid.uuid4().hex[:8]}"
        assert self._pid is not None
        try:
            copied, killed = await asyncio.gather(copy_tree(src / "layer", fresh),
                                                  process_restart.kill_agent(self._zygote, self._pid, _is_guest),
                                                  return_exceptions=True)
            for err in (killed, copied):
                if isinstance(err, BaseException):
                    raise err
            uid = self.driver.host_uid
            if uid is not None:
                _own_tree(fresh, uid)
            self._mount_points(fresh)
            process_restart.swap_contents(self.layer, fresh, trash,
                                          tuple((self.meta.get("shared") or {}).get("paths") or ()))
            if self.socket_path.exists():
                self.socket_path.unlink()
            self.quota_exceeded = False
            await process_restart.start_agent(self._zygote)
            self._channel = await self._connect(_START_TIMEOUT_S)
            self._serve_dns()
        except process_restart.ZygoteGone:
            raise  # the caller restarts the sandbox the slow way, from the checkpoint again
        except BaseException:
            # No agent running and the layer maybe half swapped: stopped; the next start begins from the layer
            # (the caller's intent, recorded before, finishes the rollback).
            await self._kill()
            self._state = SandboxState.STOPPED
            self._save(pid=None, pid_starttime=None)
            raise
        finally:
            _background(asyncio.to_thread(shutil.rmtree, fresh, True), f"rm-layer-{self.id}")
            _background(asyncio.to_thread(shutil.rmtree, trash, True), f"rm-layer-{self.id}")
        self._save(boot_count=self.meta.get("boot_count", 0) + 1)
        self._start_watchdog()
        log.info("sandbox rolled back in place", sandbox=self.id)

    async def destroy(self) -> None:
        async with self._lock:
            await self._kill()
            self._state = SandboxState.DESTROYED
            shutil.rmtree(self.dir, ignore_errors=True)
            self.driver._open.pop(self.id, None)
            shared = self.meta.get("shared")
            if shared:  # a deleted template it bound goes with its last fork
                process_templates.drop_child(process_templates.template_of(self.meta, self.driver.template_dir), self.id)
            log.info("sandbox destroyed", sandbox=self.id)

    async def stats(self) -> SandboxStats:
        st = self.state
        rss = 0
        if st is SandboxState.RUNNING and self._pid is not None:
            mem = self.cgroup.memory_bytes()
            rss = mem if mem is not None else limits.rss_bytes([self._pid, *limits.descendants(self._pid)])
        ck = self.dir / "checkpoints"
        return SandboxStats(
            state=st,
            host_rss_bytes=rss,
            disk_bytes=disk_usage(self.layer) if self.layer.exists() else 0,
            snapshot_bytes=0,  # the layer is the snapshot: no memory image exists
            checkpoint_bytes=disk_usage(ck) if ck.exists() else 0,
            pid=self._pid if st is SandboxState.RUNNING else None,
        )

    async def _adopt(self) -> None:
        """After a host restart: re-attach to a live supervisor, or record that it is gone."""
        if self._state is not SandboxState.RUNNING:
            return
        if self._alive():
            try:
                self._channel = await self._connect(10.0)
                self._serve_dns()
                self._start_watchdog()
                log.info("sandbox re-attached", sandbox=self.id, pid=self._pid)
                return
            except SandboxError as e:
                log.warning("live sandbox did not answer; stopping it", sandbox=self.id, error=str(e))
                await self._kill()
        else:
            # It died with its host: nothing of it runs, but its cgroup was never removed (the host that
            # would have removed it is gone). Removed now; the next boot makes a new one.
            self.cgroup.remove()
        self._state = SandboxState.STOPPED
        self._save(pid=None, pid_starttime=None)


def _with_seccomp(argv: list[str], fd: int) -> list[str]:
    """``argv`` (a bubblewrap command) with the seccomp filter on ``fd`` applied to the sandbox."""
    return [argv[0], "--seccomp", str(fd), *argv[1:]]


def _stage_script(sources: dict[str, Path]) -> str:
    """Shell run as root in the launcher's private mount namespace: binds each source under ``STAGE``.

    Sources are opened before the stage's tmpfs goes up (a source may live under the stage's path, e.g. /tmp)
    and bound from their descriptors, which are closed again before the rest of the command runs.
    """
    fds = {name: 3 + i for i, name in enumerate(sources)}
    if max(fds.values()) > 9:
        raise SandboxError(f"too many directories to stage ({len(fds)})")
    lines = ["set -e"]
    lines += [f"exec {fds[name]}<{shlex.quote(str(path))}" for name, path in sources.items()]
    lines.append(f"mount -t tmpfs -o mode=0755,size=64k moorage {STAGE}")
    lines += [f"mkdir {STAGE}/{name}; mount --bind /proc/self/fd/{fds[name]} {STAGE}/{name}" for name in sources]
    lines.append("exec " + " ".join(f"{fd}<&-" for fd in fds.values()) + ' "$@"')
    return "\n".join(lines)


def _own_tree(path: Path, uid: int) -> None:
    """Give a sandbox layer to the sandbox uid (layers made before it ran unprivileged belong to root)."""
    if path.stat().st_uid == uid:
        return
    for top, dirs, files in os.walk(path):
        os.lchown(top, uid, uid)
        for name in dirs + files:
            os.lchown(os.path.join(top, name), uid, uid)
    os.chmod(path, 0o700)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return "(no log)"
    return data.decode("utf-8", "replace").strip() or "(empty)"
