"""QEMU command lines and processes for the micro-VM driver: one ``-M microvm`` process per awake sandbox.

The device layout built here is part of every snapshot's identity (a snapshot restores only into the same
QEMU binary and layout), so it is hashed into ``layout_id`` and checked before a wake. QEMU runs under its own
seccomp sandbox, with its sockets in the sandbox's private run directory and its console capped on disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from moorage.errors import UnavailableError
from moorage.log import get_logger
from moorage.sandbox import capped_log, cgroups, microvm_user
from moorage.sandbox.base import SandboxError
from moorage.sandbox.accel import QEMU, accel_args
from moorage.sandbox.image_guest import CHANNEL_PORT
from moorage.sandbox.microvm_guest_port import PORT_ID

#: Bumped when the layout below changes in a way its inputs do not show.
LAYOUT_VERSION = "1"
#: QEMU's own seccomp filter: no exec/fork, no set*id, no scheduler/affinity changes, no obsolete syscalls.
#: Nothing in this driver needs what it denies (migration goes through fd:, snapshots through QMP).
SANDBOX_ARG = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: The guest's serial console on disk: console.log up to this size, then it becomes console.log.1 (one kept).
CONSOLE_CAP_BYTES = 512 << 10
#: Longest unix socket path bind()/connect() take (sun_path); longer ones are reached through a directory fd.
_SUN_PATH_MAX = 100

log = get_logger(__name__)


@dataclass(frozen=True)
class VMConfig:
    """What decides the guest-visible machine. Paths are passed separately: they differ between wakes."""

    memory_mib: int
    vcpus: int
    accel: str
    kernel_cmdline: str
    #: A virtio-net device on a tap in a namespace of its own (sandbox/microvm_net.py); network agents only.
    nic: bool = False

    def layout_id(self) -> str:
        nic = "|nic" if self.nic else ""  # layouts without a NIC keep the ids they always had
        return hashlib.sha256(f"{LAYOUT_VERSION}|{self.memory_mib}|{self.vcpus}|{self.accel}|{self.kernel_cmdline}{nic}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class VMPaths:
    kernel: Path
    initrd: Path
    disk: Path
    ram: Path
    console_log: Path
    qmp_sock: Path
    chan_sock: Path


@lru_cache(maxsize=1)
def qemu_binary() -> str:
    exe = shutil.which(QEMU)
    if exe is None:
        raise UnavailableError(f"{QEMU} is not installed", hint="apt-get install qemu-system-x86 qemu-utils (scripts/bootstrap.sh)")
    return exe


@lru_cache(maxsize=1)
def qemu_version() -> str:
    """The binary's version line plus its size and mtime: a snapshot only restores into the same build."""
    exe = qemu_binary()
    line = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
    st = os.stat(exe)
    return f"{line.strip()} [{st.st_size}:{int(st.st_mtime)}]"


def host_tsc_khz() -> int | None:
    """Under TCG the guest TSC ticks at the host TSC rate. Telling the guest kernel that rate avoids its PIT-based
    calibration, which fails on a loaded host and then hangs boot waiting for timer interrupts."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((l for l in info.splitlines() if l.startswith("flags")), "")
    if "constant_tsc" not in flags.split():
        return None
    for line in info.splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return None


def kernel_cmdline(base: str, accel: str) -> str:
    if accel == "tcg":
        khz = host_tsc_khz()
        if khz:
            return f"{base} tsc_early_khz={khz} tsc=reliable"
    return base


def build_argv(name: str, cfg: VMConfig, paths: VMPaths, *, ram_shared: bool, incoming: bool,
               tap_fd: int | None = None) -> list[str]:
    """The full QEMU command line. Wakes use the same one plus ``-incoming defer``. ``tap_fd``: the launch's tap
    (inherited by QEMU), required when the layout has a NIC."""
    if cfg.nic and tap_fd is None:
        raise SandboxError("this micro-VM's layout has a network device but no tap was made for it")
    mem = f"{cfg.memory_mib}M"
    argv = [
        qemu_binary(),
        "-name", f"moorage-{name}",
        # suppress-vmdesc: our device-state files carry no JSON description; x-option-roms=off: faster boot.
        "-M", "microvm,x-option-roms=off,suppress-vmdesc=on,memory-backend=mem",
        *accel_args(cfg.accel),
        "-m", mem,
        "-smp", str(cfg.vcpus),
        # Guest RAM is a file: shared for a sandbox's own RAM (sleep = fsync it), private over a template's RAM
        # for forks (pages the guest writes are copied on write, and only those are saved).
        "-object", f"memory-backend-file,id=mem,size={mem},mem-path={paths.ram},share={'on' if ram_shared else 'off'}",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-sandbox", SANDBOX_ARG,
        # The console goes through a FIFO the host drains into a capped, rotated console.log (a guest printing
        # forever must not fill the host's disk); no host reading it means its output is dropped.
        "-serial", f"file:{console_pipe(paths.console_log)}",
        # Names the run directory on the command line (how a QEMU of this sandbox is recognised after a restart).
        "-pidfile", str(paths.qmp_sock.parent / "qemu.pid"),
        # No network device unless the layout has one (then a tap whose namespace holds only the gateway).
        # lazy-refcounts: a checkpoint's qcow2 internal snapshot shares every cluster, and each first write after
        # it copies one; without this, each copy also writes refcount blocks in order before the guest's write
        # completes (under CPU load that made the turn after a checkpoint ~20 ms slower). The image is marked
        # dirty while open: a clean exit (a sleep quits QEMU) writes the refcounts, and a killed QEMU's image is
        # repaired by the next writable open (QEMU or qemu-img) before use.
        "-drive", f"id=disk,file={paths.disk},format=qcow2,if=none,cache=writeback,discard=unmap,detect-zeroes=unmap,"
                  "lazy-refcounts=on",
        "-device", "virtio-blk-device,drive=disk",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=ch0,path={paths.chan_sock},server=on,wait=off",
        # Its id names it in QEMU's VSERPORT_CHANGE event: the guest closing it is how the host hears its supervisor
        # exit (microvm_guest_port.py).
        "-device", f"virtserialport,chardev=ch0,name={CHANNEL_PORT},id={PORT_ID}",
        "-qmp", f"unix:{paths.qmp_sock},server=on,wait=off",
        # Our device-state files come from xen-save-devices-state, which writes no configuration section.
        "-global", "migration.send-configuration=off",
    ]
    if cfg.nic:
        from moorage.sandbox.microvm_net import netdev_args

        argv += netdev_args(tap_fd)  # type: ignore[arg-type]
    if incoming:
        argv += ["-incoming", "defer"]
    else:
        argv += ["-kernel", str(paths.kernel), "-initrd", str(paths.initrd), "-append", cfg.kernel_cmdline]
    return argv


def run_dir_for(sandbox_dir: Path) -> Path:
    """The sandbox's private run directory (its monitor and channel sockets), inside its own directory."""
    return sandbox_dir / "run"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` mode 0700, or accept an existing one only if it is a real directory of ours, mode 0700.

    Whoever can create files in it can pose as the guest's channel or the monitor: a directory someone else made
    first (or made group/world accessible) is refused, not repaired.
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise SandboxError(
            f"refusing run directory {path}: owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}"
            f"{'' if stat.S_ISDIR(st.st_mode) else ' (not a directory)'}; it must be ours (uid {os.geteuid()}), mode 700",
            hint=f"remove {path} (no QEMU of this sandbox may be running) and try again",
        )
    return path


def console_pipe(console_log: Path) -> Path:
    return console_log.with_name("console.pipe")


#: The console FIFOs this process drains, each with the event that stops its reader: a driver that lets a running
#: QEMU go (``console_release``) stops reading it, and one that re-attaches to it (``console_reattach``) reads it.
_consoles: dict[str, tuple[threading.Event, threading.Thread]] = {}
_consoles_lock = threading.Lock()


def _drain_console(fd: int, pipe: Path, alive: Callable[[], bool], pid: int) -> None:
    stop = threading.Event()
    with _consoles_lock:  # started and registered under the lock: a release right after always finds it
        thread = capped_log.start(fd, pipe.with_name("console.log"), alive=alive, cap=CONSOLE_CAP_BYTES,
                                  name=f"console-{pid}", stop=stop)
        _consoles[str(pipe)] = (stop, thread)


def console_settled(pipe: Path, timeout: float = 0.1) -> None:
    """Once its QEMU has exited, wait (up to ``timeout``) for the console's last output to reach console.log."""
    with _consoles_lock:
        entry = _consoles.get(str(pipe))
    capped_log.settled(entry[1] if entry else None, timeout)


def console_reattach(pipe: Path, pid: int, marker: str) -> bool:
    """Drain the console of a running QEMU this process did not start (re-adopted after a host restart; ``marker``
    as for ``pid_is_ours``): while no host read it, the guest's console output was dropped (QEMU's writes to a FIFO
    without a reader fail); from here it reaches console.log again. False if there is no console FIFO to read."""
    console_release(pipe)  # an earlier driver instance in this process stops reading it first
    try:
        if not stat.S_ISFIFO(os.lstat(pipe).st_mode):
            return False
        fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    _drain_console(fd, pipe, lambda: pid_is_ours(pid, marker), pid)
    return True


def console_release(pipe: Path, *, stop: bool = True) -> None:
    """This process no longer reads ``pipe``'s console: with ``stop`` its reader ends now (its QEMU runs on for
    another host), without it the reader ends when the QEMU's end closes (the output before that is kept)."""
    with _consoles_lock:
        entry = _consoles.pop(str(pipe), None)
    if entry is not None and stop:
        entry[0].set()


def _arg_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def spawn(argv: list[str], log_path: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start QEMU in its own session so it outlives a crashed host process (it is re-adopted via its pidfile).

    Sockets whose path is too long for sun_path are bound through an inherited descriptor of the run directory;
    the console FIFO is opened for reading first (QEMU would block opening it) and drained by a thread.
    """
    run_dir = Path(_arg_after(argv, "-pidfile")).parent
    pipe = Path(_arg_after(argv, "-serial").removeprefix("file:"))
    # On a root host QEMU runs as the sandbox's own unprivileged uid and opens no host path by name: its files,
    # sockets and console are passed as descriptors, their owners and modes set there (sandbox/microvm_user.py).
    launch = microvm_user.prepare(argv, run_dir, pipe) if os.geteuid() == 0 else None
    # The guest's memory and disk are readable by this host user only (their directories are 0700 as well).
    os.chmod(run_dir.parent, 0o700)
    for arg in argv if launch is None else ():
        for key in ("mem-path=", "file="):
            if key in arg:
                target = Path(arg.split(key, 1)[1].split(",", 1)[0])
                if target.exists() and target.stat().st_mode & 0o077:
                    os.chmod(target, stat.S_IMODE(target.stat().st_mode) & 0o700)
    dir_fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY)
    via_fd = f"/proc/self/fd/{dir_fd}/"
    argv = [a.replace(f"{run_dir}/", via_fd) if _is_socket_arg(a) and len(str(run_dir)) + 12 > _SUN_PATH_MAX else a
            for a in argv]
    if pipe.exists() and not stat.S_ISFIFO(os.lstat(pipe).st_mode):
        pipe.unlink()
    if not pipe.exists():
        os.mkfifo(pipe, 0o600)
    console_fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    cgroup = _cpu_cgroup(run_dir, int(_arg_after(argv, "-smp")))
    try:
        with open(log_path, "ab") as out:
            os.fchmod(out.fileno(), 0o600)
            proc = microvm_user.popen(launch, _in_cgroup(cgroup, launch.argv if launch else argv), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=out, start_new_session=True, close_fds=True, pass_fds=[dir_fd, *pass_fds])
    except BaseException:
        os.close(console_fd)
        if cgroup is not None:
            cgroups.remove_when_empty(cgroup)
        raise
    finally:
        os.close(dir_fd)
        if launch is not None:
            launch.close()
    _drain_console(console_fd, pipe, lambda: proc.poll() is None, proc.pid)
    if cgroup is not None:
        threading.Thread(target=_remove_cgroup_after, args=(proc.pid, cgroup), name=f"cgroup-{proc.pid}",
                         daemon=True).start()
    return proc


#: CPU a QEMU may use beyond its vCPUs: its main loop and I/O threads (device emulation, the channel, migration).
EMULATOR_CPU = 0.5


def _cpu_cgroup(run_dir: Path, vcpus: int) -> Path | None:
    """A CPU cgroup for one QEMU process: the same weight as every other sandbox, at most its vCPUs plus
    ``EMULATOR_CPU`` cores. Named per start, so a QEMU still dying after a stop never shares (or loses) its cgroup
    with the next one."""
    control = cgroups.cpu_control()
    if not control.kind:
        return None
    tag = hashlib.sha256(str(run_dir.parent.resolve()).encode()).hexdigest()[:12]
    try:
        return control.create(f"vm-{tag}-{uuid.uuid4().hex[:8]}", vcpus + EMULATOR_CPU)
    except OSError as e:  # fairness, not confinement: the sandbox starts without its share, and says so
        log.warning("could not make the CPU cgroup of a micro-VM; it runs without a CPU share", error=str(e))
        return None


def _in_cgroup(cgroup: Path | None, argv: list[str]) -> list[str]:
    """A shell joins the cgroup, then execs QEMU (same pid): no QEMU thread ever runs outside it."""
    if cgroup is None:
        return argv
    join = 'echo $$ > "$1" || echo "moorage: could not join CPU cgroup $1" >&2; shift; exec "$@"'
    return ["/bin/sh", "-c", join, "moorage-vm", str(cgroup / "cgroup.procs"), *argv]


def _remove_cgroup_after(pid: int, cgroup: Path) -> None:
    """Wait for QEMU to exit without reaping it (its owner does that), then remove its empty cgroup."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass  # already reaped: it has exited
    for _ in range(100):  # the kernel moves an exited process out of its cgroup a moment after exit
        if cgroups.remove_when_empty(cgroup):
            return
        time.sleep(0.05)
    log.warning("CPU cgroup of a stopped micro-VM not removed", cgroup=str(cgroup))


def _is_socket_arg(arg: str) -> bool:
    return arg.startswith(("socket,", "unix:"))


def pid_is_ours(pid: int, marker: str) -> bool:
    """Is ``pid`` alive and a QEMU whose command line contains ``marker`` (guards against pid reuse)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and marker in cmdline


def kill_pid(pid: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 5.0) -> None:
    """SIGKILL and wait until gone (reaping it when it is our child)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return
            try:
                # Someone else's zombie, and none of its threads left: gone as far as resources go. Its main thread
                # is a zombie as soon as it exits, while the others may still be exiting (unmapping a large guest's
                # memory) with its files, the disk's lock among them, still open.
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z" and \
                        os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                    return
            except OSError:
                return
        time.sleep(0.005)
