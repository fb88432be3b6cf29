"""Which accelerator micro-VMs use: KVM only when it really boots our guest kernel, else TCG.

``/dev/kvm`` can exist and open yet be unusable (e.g. a nested PVM hypervisor that stock kernels do not boot
under), so the probe boots the guest kernel + initramfs and waits for a marker (on such a host it waits out
``PROBE_TIMEOUT_S``). The verdict is cached per host boot beside the kernel it booted, in the images directory: every
data directory that shares those images (a host's, a test's, a bench's) probes once, not once each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moorage.config import Config
from moorage.errors import ConfigError, MoorageError
from moorage.log import get_logger
from moorage.sandbox.image_guest import KERNEL_CMDLINE, PROBE_MARKER

log = get_logger(__name__)

PROBE_TIMEOUT_S = 10.0
QEMU = "qemu-system-x86_64"
#: One probe at a time per verdict cache in this process: a second caller waits, then reads the first one's verdict.
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


@dataclass(frozen=True)
class ProbeResult:
    usable: bool
    detail: str
    fix: str = ""


def accel_args(accel: str) -> list[str]:
    """QEMU arguments for an accelerator. The CPU model is part of a snapshot's identity: keep it stable."""
    if accel == "kvm":
        return ["-accel", "kvm", "-cpu", "host"]
    if accel == "tcg":
        # A bounded translation cache keeps host RSS per VM predictable (the default grows to 1 GiB).
        return ["-accel", "tcg,tb-size=128", "-cpu", "max"]
    raise ConfigError(f"unknown accelerator {accel!r}", hint="set accel to auto, kvm or tcg")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _cache_path(images_dir: Path) -> Path:
    return images_dir / ".kvm-probe.json"


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def probe_kvm(cfg: Config, *, kernel: Path | None = None, initrd: Path | None = None, use_cache: bool = True,
              images_dir: Path | None = None) -> ProbeResult:
    """Boot the guest kernel under KVM and report whether it reached the initramfs (cached per host boot in
    ``images_dir``, by default the configuration's)."""
    images_dir = images_dir or cfg.images_dir
    if not os.path.exists("/dev/kvm"):
        return ProbeResult(False, "/dev/kvm does not exist", "enable hardware virtualization and load the kvm module")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return ProbeResult(False, "/dev/kvm is not accessible to this user", "add the user to the kvm group")
    exe = shutil.which(QEMU)
    if exe is None:
        return ProbeResult(False, f"{QEMU} not found", "apt-get install qemu-system-x86")
    if kernel is None or initrd is None:
        try:
            from moorage.sandbox.image import ImageBuilder

            kdir = ImageBuilder(images_dir).kernel_layer()
        except MoorageError as e:
            return ProbeResult(False, f"no guest kernel to probe with: {e.message}", e.hint or "run `moorage image build`")
        kernel, initrd = kdir / "vmlinuz", kdir / "initrd.img"
    # The kernel by its contents: the image's copy and the kernel layer's (doctor's) are one kernel, one verdict.
    key = {"boot_id": _boot_id(), "qemu": exe, "qemu_mtime": os.stat(exe).st_mtime, "kernel": _digest(kernel)}
    cache = _cache_path(images_dir)
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(os.path.realpath(cache), threading.Lock())
    with lock:  # a probe already under way in this process (started beside the image build): wait for its verdict
        return _probe_cached(exe, kernel, initrd, key, cache, use_cache)


def _probe_cached(exe: str, kernel: Path, initrd: Path, key: dict[str, object], cache: Path,
                  use_cache: bool) -> ProbeResult:
    if use_cache:
        try:
            cached = json.loads(cache.read_text())
            if cached.get("key") == key:
                return ProbeResult(**cached["result"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
    result = _boot_probe(exe, kernel, initrd)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # hosts sharing the images may write at once
        tmp.write_text(json.dumps({"key": key, "result": asdict(result)}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a cache we cannot write only costs another probe
    log.info("kvm probe", usable=result.usable, detail=result.detail)
    return result


def _boot_probe(exe: str, kernel: Path, initrd: Path) -> ProbeResult:
    argv = [
        exe, "-M", "microvm", *accel_args("kvm"), "-m", "128", "-nodefaults", "-no-user-config", "-display", "none",
        "-no-reboot", "-serial", "stdio", "-kernel", str(kernel), "-initrd", str(initrd),
        "-append", f"{KERNEL_CMDLINE} moorage.probe",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        if PROBE_MARKER.encode() in out:
            return ProbeResult(True, f"guest kernel booted in {time.monotonic() - started:.1f} s")
        return ProbeResult(
            False,
            f"a guest kernel did not boot under KVM within {PROBE_TIMEOUT_S:.0f} s (nested or paravirtual KVM?)",
            "use a host with hardware KVM for near-native speed; moorage runs guests under TCG meanwhile",
        )
    elapsed = time.monotonic() - started
    if PROBE_MARKER.encode() in out:
        return ProbeResult(True, f"guest kernel booted in {elapsed:.1f} s")
    why = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1][:300]
    return ProbeResult(
        False,
        f"QEMU could not run a guest under this KVM (nested or paravirtual KVM, e.g. PVM?): {why}",
        "use a host with hardware KVM for near-native speed (check `dmesg`); moorage uses TCG meanwhile",
    )


def choose_accel(cfg: Config) -> str:
    """``kvm`` or ``tcg`` for this host, honouring an explicit ``accel`` setting."""
    if cfg.accel in ("kvm", "tcg"):
        return cfg.accel
    if cfg.accel != "auto":
        raise ConfigError(f"unknown accel setting {cfg.accel!r}", hint="set accel to auto, kvm or tcg")
    return "kvm" if probe_kvm(cfg).usable else "tcg"
