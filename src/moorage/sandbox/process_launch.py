"""Starting a process sandbox (a part of ``ProcessSandbox``): the layout its guest runs in, the launch command
(staged as root, seccomp, rlimits, its cgroup joined first), the output log, and the wait for its supervisor."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from moorage.fsync import fsync_dir
from moorage.log import get_logger
from moorage.sandbox import capped_log, process_checkpoints, process_restart, process_seccomp
from moorage.sandbox import process_limits as limits
from moorage.sandbox.base import ChannelError, GuestProtocolError, RemoteError, SandboxError, SandboxState
from moorage.sandbox.channel import Channel
from moorage.sandbox.process_fs import proc_starttime

log = get_logger("moorage.sandbox.process_sandbox")


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
START_TIMEOUT_S = 30.0
#: supervisor.log (the sandbox's stdout and stderr) up to this size, then rotated to supervisor.log.1.
SUPERVISOR_LOG_CAP_BYTES = 512 << 10
#: Where a root host's launcher binds the sandbox's own directories in its private mount namespace, so the
#: unprivileged sandbox uid never needs to traverse the data directory's parents (e.g. /root, mode 0700).
STAGE = "/tmp"
STOP_TIMEOUT_S = 5.0

_tasks: set[asyncio.Task] = set()


def background(coro: Any, name: str) -> None:
    """Run ``coro`` without awaiting it, keeping a reference until it ends (the loop only holds weak ones)."""
    t = asyncio.get_running_loop().create_task(coro, name=name)
    _tasks.add(t)
    t.add_done_callback(_tasks.discard)


def is_guest(pid: int) -> bool:
    """Whether ``pid`` runs the guest package (the zygote or a supervisor; bwrap's own argv names it too)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[0] == SUPERVISOR_PYTHON.encode() and GUEST_MOUNT.encode() in argv


class Launching:
    """``ProcessSandbox``'s start of its guest (it holds the state this uses: the driver, spec, cgroup, process,
    channel, zygote and meta)."""

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
            own_tree(self.layer, uid)
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
            self._channel = await self._connect(START_TIMEOUT_S)
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
        (both hidden names), and checkpoints whose removal it interrupted. Runs under the sandbox's lock, so no rollback is
        making one now; a removal still running from the last rollback is harmless to repeat. A rollback killed
        between moving the layer aside and renaming its whole copy in left no layer: that copy (named by the same
        token as the layer moved aside) becomes the layer first."""
        if not self.layer.exists():
            for old in sorted(self.dir.glob(".layer-old-*")):
                fresh = self.dir / (".layer-rollback-" + old.name[len(".layer-old-"):])
                if fresh.is_dir():
                    os.rename(fresh, self.layer)
                    fsync_dir(self.dir)
                    log.warning("finished a rollback a host stop cut short", sandbox=self.id)
                    break
        for d in self.dir.iterdir():
            if d.name.startswith((".layer-rollback-", ".layer-old-")) and d.is_dir():
                background(asyncio.to_thread(shutil.rmtree, d, True), f"rm-layer-{self.id}")
        cks = self.dir / "checkpoints"
        for d in cks.glob(".*.deleting-*") if cks.is_dir() else ():
            background(asyncio.to_thread(shutil.rmtree, d, True), f"rm-checkpoint-{self.id}")
        # Checkpoints whose making a crash cut short (their hidden copies, no checkpoint's name).
        background(asyncio.to_thread(process_checkpoints.sweep_unfinished, self.dir), f"rm-checkpoint-{self.id}")

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


def own_tree(path: Path, uid: int) -> None:
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
