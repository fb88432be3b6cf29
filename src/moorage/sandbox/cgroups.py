"""Where sandbox cgroups live, and their CPU share: one parent moorage owns, found the same way on any host.

cgroup v2 inside the host process's own cgroup (a systemd unit with ``Delegate=yes``), else the v1 ``cpu``
hierarchy; on a host with neither, sandboxes get no CPU share and the host logs that once.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from moorage.log import get_logger

log = get_logger(__name__)

#: The parent of every sandbox's cgroup, inside the cgroup the host process started in.
SANDBOXES = "moorage-sandboxes"
#: cgroup v2 lets a cgroup with processes in it hand controllers to children only at the root: elsewhere the host
#: process moves itself into this leaf first (what systemd expects of a service with ``Delegate=yes``).
HOST_LEAF = "moorage-host"
#: A sandbox's weight beside its siblings (v2 ``cpu.weight``, default 100; v1 ``cpu.shares`` scales it to 1024):
#: every sandbox the same however many processes or threads it runs.
SANDBOX_WEIGHT = 100
#: v1 and v2 count CPU time in periods of this many microseconds; ``cpu.max`` allows a sandbox ``vcpus`` of them.
PERIOD_US = 100_000

_CONTROLLERS = ("cpu", "pids", "memory")


@dataclass(frozen=True)
class Mount:
    """One cgroup hierarchy as this process sees it: where it is mounted and the process's own cgroup in it."""

    root: Path
    own: str  # "/system.slice/moorage.service", "/" in a root or namespaced cgroup

    @property
    def own_dir(self) -> Path:
        return self.root / self.own.lstrip("/")


def parse_mounts(mountinfo: str, proc_cgroup: str) -> tuple[Mount | None, Mount | None]:
    """The v2 hierarchy and the v1 hierarchy holding the ``cpu`` controller, from /proc/self/mountinfo and
    /proc/self/cgroup (either may be None)."""
    v2_root: Path | None = None
    v1_cpu_root: Path | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        mount_point = Path(fields[4].replace("\\040", " "))
        if rfields[0] == "cgroup2" and v2_root is None:
            v2_root = mount_point
        elif rfields[0] == "cgroup" and "cpu" in rfields[2].split(",") and v1_cpu_root is None:
            v1_cpu_root = mount_point
    v2_own = v1_own = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2_own = path
        elif "cpu" in controllers.split(","):
            v1_own = path
    return (Mount(v2_root, v2_own) if v2_root and v2_own is not None else None,
            Mount(v1_cpu_root, v1_own) if v1_cpu_root and v1_own is not None else None)


def group_weight() -> int:
    """Weight of all sandboxes together: as much as one busy process per CPU of the host. Where the host process
    and other programs sit in the same cgroup as that parent (v1, or a root cgroup) each of their threads weighs
    one; a lighter parent would starve every sandbox whenever other work keeps the machine busy. Where the host
    has its own leaf (v2, delegated) the leaf gets the same weight: the host serving every tenant keeps half. The
    CPUs are those the host may use (``moorage.cpus``: a container's quota narrows them), not the machine's."""
    from moorage.cpus import usable_cpus  # it reads this module's quota

    return SANDBOX_WEIGHT * usable_cpus()


def _write_weight(d: Path, kind: str, weight: int) -> None:
    if kind == "v2":
        (d / "cpu.weight").write_text(str(min(10_000, weight)))
    else:
        (d / "cpu.shares").write_text(str(weight * 1024 // 100))


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _enable(level: Path, controllers: set[str]) -> set[str]:
    """Hand ``controllers`` (those ``level`` has) to its children; returns the ones now enabled."""
    want = controllers & set(_read(level / "cgroup.controllers").split())
    for c in sorted(want - set(_read(level / "cgroup.subtree_control").split())):
        try:
            (level / "cgroup.subtree_control").write_text(f"+{c}")
        except OSError as e:
            if e.errno == errno.EBUSY:  # processes live in ``level``: the caller may move them and retry
                raise
            # One controller refused (cpu, while a real-time thread runs below) must not cost the others.
            log.info("cgroup controller not enabled", cgroup=str(level), controller=c, error=str(e))
    return want & set(_read(level / "cgroup.subtree_control").split())


def delegate_v2(mount: Mount, controllers: set[str]) -> tuple[Path, set[str]] | None:
    """Make ``<own cgroup>/moorage-sandboxes`` with as many of ``controllers`` as the host delegates to us.

    Returns the parent directory and the controllers its children get, or None when this process may not make
    cgroups there. Moves the host process into ``moorage-host`` when its own cgroup must stay free of processes.
    """
    base = mount.own_dir
    if not os.access(base, os.W_OK):
        return None
    try:
        enabled = _enable(base, controllers)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        # "No internal processes": the host's own cgroup cannot delegate while a process lives in it.
        leaf = base / HOST_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        enabled = _enable(base, controllers)  # still EBUSY: processes that are not ours live there too
    if not enabled:
        return None
    parent = base / SANDBOXES
    parent.mkdir(exist_ok=True)
    return parent, _enable(parent, enabled)


@dataclass(frozen=True)
class CpuControl:
    """How sandboxes get their CPU share on this host: ``kind`` is "v2", "v1" or "" (none), ``parent`` the
    directory their cgroups are made in (for v2 the same one ``process_limits`` uses for pids and memory)."""

    kind: str
    parent: Path | None = None

    def dir_for(self, name: str) -> Path | None:
        return self.parent / name if self.kind and self.parent else None

    def create(self, name: str, cpus: float) -> Path | None:
        """Make (or reuse) the sandbox's cgroup with its weight and a ceiling of ``cpus`` cores; returns its
        directory (join it through ``cgroup.procs``), or None on a host without CPU control."""
        d = self.dir_for(name)
        if d is None:
            return None
        d.mkdir(exist_ok=True)
        quota = max(1000, int(cpus * PERIOD_US))
        _write_weight(d, self.kind, SANDBOX_WEIGHT)
        if self.kind == "v2":
            (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        return d

    def settings(self, name: str) -> dict[str, str]:
        """The sandbox's CPU settings as the kernel reports them (empty without CPU control)."""
        d = self.dir_for(name)
        if d is None:
            return {}
        files = ("cpu.weight", "cpu.max") if self.kind == "v2" else ("cpu.shares", "cpu.cfs_quota_us", "cpu.cfs_period_us")
        return {f: _read(d / f).strip() for f in files}


def cpu_quota(v2: Mount | None, v1: Mount | None) -> float | None:
    """The CPUs' worth of time the tightest quota on this process's cgroup path allows (its own cgroup's or an
    ancestor's: each binds; v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None where none is set."""
    tightest: float | None = None
    for mount, files in ((v2, ("cpu.max",)), (v1, ("cpu.cfs_quota_us", "cpu.cfs_period_us"))):
        if mount is None:
            continue
        d = mount.own_dir
        while True:
            words = " ".join(_read(d / f).strip() for f in files).split()
            try:
                quota, period = (int(words[0]), int(words[1])) if len(words) == 2 and words[0] != "max" else (-1, 0)
            except ValueError:
                quota, period = -1, 0
            if quota > 0 and period > 0:  # v1 says -1, v2 "max", for none; the root cgroup has no file
                tightest = quota / period if tightest is None else min(tightest, quota / period)
            if d == mount.root or mount.root not in d.parents:
                break
            d = d.parent
    return tightest


@lru_cache(maxsize=1)
def mounts() -> tuple[Mount | None, Mount | None]:
    return parse_mounts(_read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")))


_detect_lock = threading.Lock()
_v2_parent: tuple[Path, set[str]] | None | bool = False  # False: not probed yet


def v2_parent() -> tuple[Path, set[str]] | None:
    """The v2 parent of sandbox cgroups and its controllers (probed once per process; None if unusable)."""
    global _v2_parent
    with _detect_lock:
        if _v2_parent is False:
            _v2_parent = None
            v2, _ = mounts()
            # Our own cgroup first (delegated); then the hierarchy's root, where a root host may always delegate
            # (a session scope that other processes share cannot, however privileged we are).
            tries = [] if v2 is None else [v2] + ([Mount(v2.root, "/")] if v2.own != "/" else [])
            for where in tries:
                try:
                    _v2_parent = delegate_v2(where, set(_CONTROLLERS))
                except OSError as e:
                    log.info("cgroup v2 not delegated here", cgroup=str(where.own_dir), error=str(e))
                if _v2_parent is not None:
                    break
        return _v2_parent


@lru_cache(maxsize=1)
def cpu_control() -> CpuControl:
    """CPU shares for sandboxes on this host, probed once per process; logs once when there are none."""
    found = v2_parent()
    if found is not None and "cpu" in found[1]:
        parent = found[0]
        try:
            _write_weight(parent, "v2", group_weight())
            if (parent.parent / HOST_LEAF).is_dir():
                _write_weight(parent.parent / HOST_LEAF, "v2", group_weight())
            return CpuControl("v2", parent)
        except OSError as e:
            log.info("cgroup v2 cpu weights not writable", error=str(e))
    _, v1 = mounts()
    if v1 is not None and os.access(v1.own_dir, os.W_OK):
        parent = v1.own_dir / SANDBOXES
        try:
            parent.mkdir(exist_ok=True)
            _write_weight(parent, "v1", group_weight())
            return CpuControl("v1", parent)
        except OSError as e:
            log.info("cgroup v1 cpu hierarchy not writable", error=str(e))
    log.warning("no CPU control for sandboxes on this host: a busy sandbox competes with the host and its "
                "neighbours on equal terms (delegate a cgroup v2 subtree with the cpu controller to moorage, "
                "e.g. Delegate=yes in its systemd unit)")
    return CpuControl("")


def remove_when_empty(d: Path) -> bool:
    """Remove a sandbox's cgroup directory; False while processes are still inside."""
    try:
        d.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
