"""Run the bench inside a memory cgroup, so the page cache it writes through is reused, as on a server that
has been up for a while, instead of growing into memory the host has not backed recently.

Why: on a virtual machine the host may take back guest memory that the guest is not using (free page
reporting, a balloon; the bench's machine boots with ``page_reporting.page_reporting_order=11``). Measured
on the bench's machine (``python3`` touching one byte per 4 KiB page of a fresh mapping): the first ~4-6 GB
took 0.53 s/GB, every GB after that ~5 s/GB, ~19 µs per page, in every round, also right after the same
memory had been touched and freed. A full run leaves ~10 GB of SQLite files in the page cache before the
PostgreSQL half starts, so every page the server then writes (WAL, heap, TOAST) is such a page: perf showed
``copy_folio_from_iter_atomic`` (pwrite into the page cache) at 57% of moorage's backend CPU in that half
against 25% when the half ran first, and the server CPU per 16 KiB put at 0.31-0.46 ms against 0.11-0.14 ms.
The cost is per byte written, the same for either saver, so it compressed every ratio towards 1 (16 KiB
``full``, 8 writers: 1.6-1.9x after the SQLite half, 2.3-2.5x in the cgroup, 2.4-2.7x when the half ran
alone).

A memory cgroup holding this process and everything it starts (the PostgreSQL cluster, the CAS
processes) makes the kernel reclaim the bench's own older page cache at the limit and reuse those pages,
which stay backed. Durability is unchanged: pages are written back and fsynced exactly as before. The
cgroup is the one process sandboxes get (``moorage.sandbox.process_limits``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moorage.sandbox.process_limits import CGROUP_ROOT, SandboxCgroup, detect

#: Tasks (threads included) the bench's cgroup may hold: far above what a run starts.
_MAX_TASKS = 65536


class PageCacheBound:
    """``with PageCacheBound(limit) as b:`` moves this process into a new cgroup whose memory limit is
    ``limit`` bytes, and back on exit, when the cgroup is removed (with any process left in it, such as
    multiprocessing's resource tracker). ``b.description`` says what was done, or why the run is not bounded
    (no writable cgroup hierarchy, as for a process sandbox without one): the bench then runs as before."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.description = "not bounded"
        self._cgroup: SandboxCgroup | None = None
        self._home: list[Path] = []

    def __enter__(self) -> PageCacheBound:
        if self.limit <= 0:
            self.description = "not bounded (--page-cache-gib 0)"
            return self
        support = detect()
        if not support.cgroup:
            self.description = "not bounded: no writable cgroup hierarchy"
            return self
        own = _own_cgroups()
        home = {"v2": [CGROUP_ROOT / own.get("", "/").lstrip("/")],
                "v1": [CGROUP_ROOT / c / own.get(c, "/").lstrip("/") for c in ("pids", "memory")]}[support.cgroup]
        cg = self._cgroup = SandboxCgroup(support, f"bench-store-{os.getpid()}")
        self._home = home
        try:
            cg.create(_MAX_TASKS, self.limit)
            for f in cg.procs_files:
                f.write_text(str(os.getpid()))
        except OSError as e:
            self._leave()
            self.description = f"not bounded: {e}"
            return self
        self.description = (f"memory cgroup ({support.cgroup}) of {self.limit / (1 << 30):g} GiB around the bench, both "
                            "savers' processes and the PostgreSQL cluster: page cache is reclaimed and reused at the limit")
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._cgroup is None:
            return
        cg, self._cgroup = self._cgroup, None
        if os.getpid() in cg.pids():
            try:
                for d in self._home:
                    (d / "cgroup.procs").write_text(str(os.getpid()))
            except OSError as e:
                # remove() kills every process inside, this one included: leave the cgroup to the operator.
                print(f"page cache: cgroup {cg.name} left in place, could not move back: {e}", file=sys.stderr)
                return
        cg.remove()  # kills what is left inside: the server's exiting processes, helpers


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller name ("" for the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out
