"""Resource limits for process sandboxes: a per-sandbox cgroup (v2, else v1 pids+memory+cpu) plus rlimits.

What is enforced depends on the host; ``LimitSupport.enforced`` says which, and the driver declares it.
Where the cgroups live (the host process's own, delegated cgroup) is ``cgroups``' business.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from moorage.log import get_logger
from moorage.sandbox import cgroups

log = get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Name of the parent cgroup every process sandbox lives under.
PARENT = cgroups.SANDBOXES


@dataclass(frozen=True)
class LimitSupport:
    """Which mechanism this host offers. ``cgroup`` is "v2", "v1" or "" (rlimits only)."""

    cgroup: str
    v2_dir: Path | None = None
    v1_pids: Path | None = None
    v1_memory: Path | None = None
    #: The CPU share of each sandbox (v2: in the same cgroup; v1: the ``cpu`` hierarchy), if the host has one.
    cpu: cgroups.CpuControl = cgroups.CpuControl("")

    @property
    def enforced(self) -> frozenset[str]:
        # file_size (RLIMIT_FSIZE) and disk (the driver's quota watchdog) hold everywhere; memory falls back to
        # RLIMIT_AS per process. RLIMIT_NPROC does not bind a uid mapped to host root, so processes need a cgroup.
        base = {"file_size", "disk", "memory"}
        if self.cgroup:
            base.add("processes")
        if self.cpu.kind:
            base.add("cpu")
        return frozenset(base)


def _writable_dir(p: Path) -> bool:
    return p.is_dir() and os.access(p, os.W_OK)


def detect() -> LimitSupport:
    """Probe once per driver: cgroup v2 with pids+memory delegated, else writable v1 hierarchies, else nothing.
    The CPU share comes from wherever the host offers it (both are probed once per process by ``cgroups``)."""
    cpu = cgroups.cpu_control()
    found = cgroups.v2_parent()
    if found is not None and {"pids", "memory"} <= found[1]:
        return LimitSupport("v2", v2_dir=found[0], cpu=cpu if cpu.parent == found[0] else cgroups.CpuControl(""))
    pids, mem = CGROUP_ROOT / "pids", CGROUP_ROOT / "memory"
    if _writable_dir(pids) and _writable_dir(mem) and (pids / "cgroup.procs").exists():
        try:
            (pids / PARENT).mkdir(exist_ok=True)
            (mem / PARENT).mkdir(exist_ok=True)
            return LimitSupport("v1", v1_pids=pids / PARENT, v1_memory=mem / PARENT, cpu=cpu)
        except OSError as e:
            log.warning("cgroup v1 present but not writable; using rlimits", error=str(e))
    # No pids/memory cgroups: the CPU share alone, where the host has one.
    return LimitSupport("", cpu=cpu)


class SandboxCgroup:
    """The cgroup(s) of one sandbox: created before start, every process of the sandbox is placed in it."""

    def __init__(self, support: LimitSupport, name: str) -> None:
        self.support = support
        self.name = name
        self.dirs: list[Path] = []
        if support.cgroup == "v2" and support.v2_dir:
            self.dirs = [support.v2_dir / name]  # the CPU share, where delegated, is in this same cgroup
        elif support.cgroup == "v1" and support.v1_pids and support.v1_memory:
            self.dirs = [support.v1_pids / name, support.v1_memory / name]
        cpu_dir = support.cpu.dir_for(name)
        if cpu_dir is not None and cpu_dir not in self.dirs:
            self.dirs.append(cpu_dir)

    @property
    def bounds_memory_and_processes(self) -> bool:
        """Whether pids and memory cgroups bound this sandbox (a cgroup for the CPU share alone does not)."""
        return bool(self.support.cgroup) and bool(self.dirs)

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def create(self, max_processes: int, memory_bytes: int, cpus: float = 1) -> None:
        for d in self.dirs:
            d.mkdir(exist_ok=True)
        self.support.cpu.create(self.name, cpus)  # its weight among sandboxes and a ceiling of ``cpus`` cores
        if self.support.cgroup == "v2":
            d = self.dirs[0]
            (d / "pids.max").write_text(str(max_processes))
            (d / "memory.max").write_text(str(memory_bytes))
            try:
                (d / "memory.swap.max").write_text("0")
            except OSError:
                pass  # no swap accounting on this host
        elif self.support.cgroup == "v1":
            (self.dirs[0] / "pids.max").write_text(str(max_processes))
            (self.dirs[1] / "memory.limit_in_bytes").write_text(str(memory_bytes))

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(x) for x in f.read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the kernel's OOM killer ended in this cgroup (0 where not known):
        v2 ``memory.events``, v1 ``memory.oom_control``, each with an ``oom_kill`` line."""
        if self.support.cgroup == "v2" and self.dirs:
            f = self.dirs[0] / "memory.events"
        elif self.support.cgroup == "v1" and len(self.dirs) > 1:
            f = self.dirs[1] / "memory.oom_control"
        else:
            return 0
        try:
            for line in f.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def memory_bytes(self) -> int | None:
        if self.support.cgroup == "v2":
            f = self.dirs[0] / "memory.current"
        elif self.support.cgroup == "v1":
            f = self.dirs[1] / "memory.usage_in_bytes"
        else:
            return None
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return None

    def kill_all(self) -> None:
        kill_pids(self.pids())

    def remove(self) -> None:
        """Kill stragglers and remove the cgroup directories (rmdir fails while a process is inside)."""
        for attempt in range(50):
            self.kill_all()
            left = []
            for d in self.dirs:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(d)
            if not left:
                return
            time.sleep(0.02)
        log.warning("cgroup not removed; processes still inside", cgroup=self.name)


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def rlimit_args(*, max_processes: int | None, max_file_bytes: int, address_space_bytes: int) -> list[str]:
    """``prlimit`` arguments applied to the sandbox's first process and inherited by everything in it.

    ``max_processes=None`` leaves RLIMIT_NPROC as it is (a cgroup bounds the processes instead)."""
    return [
        "prlimit",
        *([f"--nproc={max_processes}"] if max_processes is not None else []),
        f"--fsize={max_file_bytes}",
        f"--as={address_space_bytes}",
        "--core=0",
        "--nofile=4096",
        "--",
    ]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (breadth first), read from /proc/<pid>/task/*/children."""
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt: list[int] = []
        for p in frontier:
            try:
                tasks = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for t in tasks:
                try:
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        nxt.extend(int(x) for x in f.read().split())
                except OSError:
                    continue
        out.extend(nxt)
        frontier = nxt
    return out


def rss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
    return total
