"""What moorage adds to a Debian tree to make it a sandbox: the boot scripts and the guest runtime layer.

Kept apart from the builder so the cheap final layer (and its hash) is easy to read and change.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import py_compile
import shutil
import sys
from pathlib import Path

from moorage.sandbox import guest_source_dir

#: Where the guest package lives inside the VM (run as ``python3 /opt/moorage/guest``).
GUEST_DIR_IN_VM = "/opt/moorage/guest"
#: Name of the virtio-serial port the guest supervisor listens on.
CHANNEL_PORT = "moorage.0"

#: Printed on the console by the initramfs when booted with ``moorage.probe`` (the KVM usability probe).
PROBE_MARKER = "MOORAGE-PROBE-OK"
#: Printed by /sbin/moorage-init when booted with ``moorage.bootcheck`` (image self-test).
BOOTCHECK_MARKER = "MOORAGE-ROOT-OK"

# microvm has no PCI and a single 8250 UART. `quiet` matters under TCG: every console byte is emulated.
# `panic=-1` + `-no-reboot` make a guest panic end the QEMU process instead of hanging.
KERNEL_CMDLINE = "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t pci=off 8250.nr_uarts=1 random.trust_cpu=on rootfstype=ext4"

INITRAMFS_INIT = r"""#!/bin/busybox sh
# moorage initramfs: load the virtio modules, mount the agent disk, hand over to /sbin/moorage-init.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /lib/modules/order); do
  insmod /lib/modules/$m.ko || echo "moorage-initramfs: insmod $m failed"
done
case " $(cat /proc/cmdline) " in
  *" moorage.probe "*) echo MOORAGE-PROBE-OK; echo o > /proc/sysrq-trigger; sleep 5 ;;
esac
i=0
while [ ! -b /dev/vda ] && [ $i -lt 500 ]; do usleep 10000; i=$((i+1)); done
if ! mount -t ext4 -o rw,noatime /dev/vda /newroot; then
  echo "moorage-initramfs: cannot mount /dev/vda (no disk or not ext4)"; echo o > /proc/sysrq-trigger; sleep 5
fi
mount --move /dev /newroot/dev
mount --move /sys /newroot/sys
mount --move /proc /newroot/proc
exec switch_root /newroot /sbin/moorage-init
"""

ROOT_INIT = r"""#!/bin/sh
# PID 1 of a moorage sandbox: minimal mounts, loopback up, then the guest supervisor (which reaps orphans).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
hostname sandbox
ip link set lo up 2>/dev/null
case " $(cat /proc/cmdline) " in
  *" moorage.bootcheck "*)
    echo "MOORAGE-ROOT-OK $(python3 -c 'import json, sys; print(json.dumps(sys.version_info[:2]))')"
    sync; echo o > /proc/sysrq-trigger; sleep 5 ;;
esac
# Limits from the host (kernel command line). Everything in the guest runs as root, for whom RLIMIT_NPROC does
# not bind, so the process cap is a pids cgroup around the supervisor and all it starts; RLIMIT_FSIZE does bind.
nproc=; fsize=; envb64=
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    moorage.nproc=*) nproc=${arg#moorage.nproc=} ;;
    moorage.fsize=*) fsize=${arg#moorage.fsize=} ;;
    moorage.env=*) envb64=${arg#moorage.env=} ;;
  esac
done
case " $(cat /proc/cmdline) " in
  # The host made this agent's disk bigger than the image's root filesystem: grow it online to fill the disk.
  *" moorage.growfs "*) resize2fs /dev/vda >/dev/null 2>&1 || echo "moorage-init: resize2fs /dev/vda failed" > /dev/console ;;
esac
if [ -n "$nproc" ] && mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null; then
  mkdir -p /sys/fs/cgroup/agent
  echo "+pids" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
  echo "$nproc" > /sys/fs/cgroup/agent/pids.max
fi
cd /
# This shell stays PID 1: its wait reaps orphaned processes (which would otherwise pile up as zombies and use
# up the process cap), and it restarts the supervisor should it ever exit.
while :; do
  # A supervisor restarted in place with another environment (guest/restart.py) left it here: it wins over the boot's.
  [ -s /run/moorage/boot-env ] && envb64=$(cat /run/moorage/boot-env)
  set -- python3 /opt/moorage/guest --virtio moorage.0 --extension moorage_vm.after_wake
  [ -n "$fsize" ] && set -- prlimit --fsize="$fsize" "$@"
  if [ -n "$envb64" ]; then
    # The sandbox spec's environment (JSON, base64url): set for the supervisor and so for everything it runs.
    set -- python3 -c 'import base64, json, os, sys
os.environ.update(json.loads(base64.urlsafe_b64decode(sys.argv[1])))
os.execvp(sys.argv[2], sys.argv[2:])' "$envb64" "$@"
  fi
  if [ -f /sys/fs/cgroup/agent/pids.max ]; then
    # The supervisor and all it starts go into the capped cgroup; PID 1 stays outside it, never a victim.
    set -- sh -c 'echo $$ > /sys/fs/cgroup/agent/cgroup.procs && exec "$@"' moorage-agent "$@"
  fi
  oom=$(sed -n 's/^oom_kill //p' /proc/vmstat)
  "$@" &
  wait $!
  status=$?
  # How it ended, for the host (sandbox/microvm_guest_port.py): its wait status, and how many processes the guest's
  # kernel killed for memory meanwhile (it counts a kill before it sends the signal): told at once, not later by
  # the next supervisor.
  echo "moorage-init: supervisor exited ($status; oom_kill +$(( $(sed -n 's/^oom_kill //p' /proc/vmstat) - ${oom:-0} ))); restarting" > /dev/console
  sleep 1
done
"""

#: Guest extension for VM-only needs (the supervisor loads it with ``--extension moorage_vm.after_wake``).
#: A VM woken from a snapshot has a clock that stood still while it slept, and a fork shares its template's
#: kernel CRNG state; both are fixed from inside the running supervisor, without starting a process.
VM_EXTENSION = '''"""microvm guest extension: set the clock and reseed the kernel CRNG after a wake (stdlib only)."""

import base64
import fcntl
import os
import struct
import time

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


async def after_wake(params, ctx):
    if params.get("time") is not None:
        time.clock_settime(time.CLOCK_REALTIME, float(params["time"]))
    seed = base64.b64decode(params.get("seed") or "")
    if seed:
        fd = os.open("/dev/urandom", os.O_WRONLY)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        finally:
            os.close(fd)
    return {"time": time.time(), "reseeded": bool(seed)}


def register(registry):
    registry.add("vm.after_wake", after_wake)
'''
VM_EXTENSION_MODULE = "moorage_vm.after_wake"

# Debian marks its Python "externally managed"; inside a throwaway sandbox the agent owns the system.
PIP_CONF = "[global]\nbreak-system-packages = true\ndisable-pip-version-check = true\n"


def _guest_files() -> list[Path]:
    src = guest_source_dir()
    return sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".json", ".txt"))


def guest_code_hash() -> str:
    """Hash of everything the final layer adds, so changed guest code gives a new image id."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())  # the boot scripts and the layering steps themselves
    src = guest_source_dir()
    for p in _guest_files():
        h.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _put(path: Path, data: str, mode: int) -> None:
    # The staging tree hard-links the debootstrap cache: replace files, never write through a shared inode.
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_text(data)
    path.chmod(mode)


def layer_guest_runtime(root: Path) -> None:
    """Add /sbin/moorage-init, pip config and the guest package to the staging tree ``root``."""
    _put(root / "sbin" / "moorage-init", ROOT_INIT, 0o755)
    _put(root / "etc" / "pip.conf", PIP_CONF, 0o644)
    _put(root / "etc" / "hostname", "sandbox\n", 0o644)
    (root / "work").mkdir(mode=0o755, exist_ok=True)  # the supervisor's default working directory
    ext = root / "opt" / "moorage" / "moorage_vm"
    _put(ext / "__init__.py", "", 0o644)
    _put(ext / "after_wake.py", VM_EXTENSION, 0o644)
    dst = root / GUEST_DIR_IN_VM.lstrip("/")
    if dst.exists():
        shutil.rmtree(dst)
    src = guest_source_dir()
    for p in _guest_files():
        target = dst / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
        os.chmod(target, 0o644)
    _precompile(root, root / "opt" / "moorage")


def _precompile(root: Path, tree: Path) -> None:
    """Compile the guest's modules into the image (its init sets PYTHONDONTWRITEBYTECODE): otherwise every
    supervisor start, a cold boot's or a restart in place's, compiles them again (under TCG the supervisor's
    imports took p50 1,352 ms compiling them, 1,122 ms with them compiled, alternating in one VM). Checked against
    their sources' hashes when imported, so a changed source is never run stale. Only a host of the guest's Python
    version can (byte code is per version); another host's image just compiles them at each start."""
    versions = {p.parent.name for p in (root / "usr" / "lib").glob("python3.*/os.py")}
    if versions != {"python%d.%d" % sys.version_info[:2]}:
        return
    ok = compileall.compile_dir(str(tree), quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    if not ok:
        raise RuntimeError(f"the guest's modules under {tree} did not compile")
