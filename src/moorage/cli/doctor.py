"""``moorage doctor``: checks the host can run moorage, one line per check with a fix.

Checks are plain functions returning a ``Check``; the CLI renders them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moorage.config import Config


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    #: A failed optional check degrades moorage (e.g. no KVM → slower TCG) but does not stop it.
    optional: bool = False


def check_qemu(cfg: Config) -> Check:
    exe = shutil.which("qemu-system-x86_64")
    if not exe:
        return Check("qemu", False, "qemu-system-x86_64 not found", "apt-get install qemu-system-x86 qemu-utils", optional=True)
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
    img = shutil.which("qemu-img")
    if not img:
        return Check("qemu", False, f"{out}; qemu-img missing", "apt-get install qemu-utils", optional=True)
    return Check("qemu", True, out)


def check_kvm(cfg: Config) -> Check:
    if not os.path.exists("/dev/kvm"):
        return Check("kvm", False, "/dev/kvm absent: micro-VMs run under TCG (slower)", "enable virtualization / load kvm module", optional=True)
    import tempfile

    from moorage.sandbox.accel import probe_kvm

    if fresh(cfg):
        # The probe keeps its kernel and verdict under the data directory: a fresh one stays as it was.
        with tempfile.TemporaryDirectory(prefix="moorage-doctor-") as scratch:
            res = probe_kvm(cfg.with_(data_dir=Path(scratch)), use_cache=False)
    else:
        res = probe_kvm(cfg)
    if res.usable:
        return Check("kvm", True, f"KVM boots a guest ({res.detail})")
    return Check("kvm", False, f"/dev/kvm opens but {res.detail}; micro-VMs use TCG", res.fix, optional=True)


def check_bubblewrap(cfg: Config) -> Check:
    exe = shutil.which("bwrap")
    if not exe:
        return Check("bubblewrap", False, "bwrap not found", "apt-get install bubblewrap", optional=True)
    r = subprocess.run([exe, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        return Check("bubblewrap", False, f"bwrap cannot create namespaces: {r.stderr.strip()}", "allow unprivileged user namespaces or run as root", optional=True)
    return Check("bubblewrap", True, exe)


def check_disk(cfg: Config) -> Check:
    path = cfg.data_dir
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    gib = free / (1 << 30)
    if gib < 2:
        return Check("disk", False, f"{gib:.1f} GiB free under {probe}", "free space or set MOORAGE_DATA_DIR to a larger disk")
    return Check("disk", True, f"{gib:.1f} GiB free under {probe}")


def check_store(cfg: Config) -> Check:
    from moorage.cli.store import NO_STORE_HINT, store_missing
    from moorage.store import open_store

    missing = store_missing(cfg)
    if missing is not None:  # nothing wrong on a new host: said, and not made here
        return Check("store", True, f"no store yet at {missing} ({NO_STORE_HINT})")

    try:
        store = open_store(cfg)
    except Exception as e:  # doctor reports, never crashes
        return Check("store", False, f"{cfg.store_url}: {e}", "check MOORAGE_STORE_URL and that the database is running")
    try:
        detail = store.describe()
    finally:
        store.close()
    return Check("store", True, detail)


CHECKS: list[Callable[[Config], Check]] = [check_qemu, check_kvm, check_bubblewrap, check_disk, check_store]


def fresh(cfg: Config) -> bool:
    """Whether the data directory is missing or empty: doctor then leaves it so."""
    return not cfg.data_dir.is_dir() or not any(cfg.data_dir.iterdir())


def run_checks(cfg: Config) -> list[Check]:
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(cfg))
        except Exception as e:
            out.append(Check(fn.__name__.removeprefix("check_"), False, f"check failed: {e}", "report this as a bug"))
    return out
