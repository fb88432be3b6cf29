"""QEMU command lines and processes for the micro-VM driver: one ``-M microvm`` process per awake sandbox.

The device layout built here is part of every snapshot's identity (a snapshot restores only into the same
QEMU binary and layout), so it is hashed into ``layout_id`` and checked before a wake.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from moorage.errors import UnavailableError
from moorage.sandbox.accel import QEMU, accel_args
from moorage.sandbox.image_guest import CHANNEL_PORT

#: Bumped when the layout below changes in a way its inputs do not show.
LAYOUT_VERSION = "1"


@dataclass(frozen=True)
class VMConfig:
    """What decides the guest-visible machine. Paths are passed separately: they differ between wakes."""

    memory_mib: int
    vcpus: int
    accel: str
    kernel_cmdline: str

    def layout_id(self) -> str:
        return hashlib.sha256(f"{LAYOUT_VERSION}|{self.memory_mib}|{self.vcpus}|{self.accel}|{self.kernel_cmdline}".encode()).hexdigest()[:16]


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


def build_argv(name: str, cfg: VMConfig, paths: VMPaths, *, ram_shared: bool, incoming: bool) -> list[str]:
    """The full QEMU command line. Wakes use the same one plus ``-incoming defer``."""
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
        "-serial", f"file:{paths.console_log}",
        # No network device at all: the guest's only way out is the channel.
        "-drive", f"id=disk,file={paths.disk},format=qcow2,if=none,cache=writeback,discard=unmap,detect-zeroes=unmap",
        "-device", "virtio-blk-device,drive=disk",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=ch0,path={paths.chan_sock},server=on,wait=off",
        "-device", f"virtserialport,chardev=ch0,name={CHANNEL_PORT}",
        "-qmp", f"unix:{paths.qmp_sock},server=on,wait=off",
        # Our device-state files come from xen-save-devices-state, which writes no configuration section.
        "-global", "migration.send-configuration=off",
    ]
    if incoming:
        argv += ["-incoming", "defer"]
    else:
        argv += ["-kernel", str(paths.kernel), "-initrd", str(paths.initrd), "-append", cfg.kernel_cmdline]
    return argv


def run_dir_for(sandbox_dir: Path) -> Path:
    """Short directory for the unix sockets (sun_path is limited to 107 bytes; sandbox paths can be long)."""
    h = hashlib.sha256(str(sandbox_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "moorage-vm" / h


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start QEMU in its own session so it outlives a crashed host process (it is re-adopted via its pidfile)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)


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
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # someone else's zombie: gone as far as resources go
            except OSError:
                return
        time.sleep(0.005)
