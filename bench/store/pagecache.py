"""Run the bench inside a memory cgroup, so the page cache it writes through is reused, as on a server that
has been up for a while, instead of growing into memory the host has not backed recently.

Why: on a virtual machine the host may take back guest memory that the guest is not using (free page
reporting, a balloon; the bench's machine boots with ``page_reporting.page_reporting_order=11``). Measured on the bench's machine (``python3`` touching one byte per 4 KiB page of a
fresh mapping): the first ~4-6 GB took 0.53 s/GB, every GB after that ~5 s/GB, ~19 µs per page, in
every round, also right after the same memory had been touched and freed. A full run leaves ~10 GB of
SQLite files in the page cache before the PostgreSQL half starts, so every page the server then writes
(WAL, heap, TOAST) is such a page: perf showed ``copy_folio_from_iter_atomic`` (pwrite into the page
cache) at 57% of moorage's backend CPU in that half against 25% when the half ran first, and the server
CPU per 16 KiB put at 0.31-0.46 ms against 0.11-0.14 ms. The cost is per byte written, the same for
either saver, so it compressed every ratio towards 1 (16 KiB ``full``, 8 writers: 1.6-1.9x after the
SQLite half, 2.3-2.5x in the cgroup, 2.4-2.7x when the half ran alone).

A memory cgroup holding this process and everything it starts (the PostgreSQL cluster, the CAS
processes) makes the kernel reclaim the bench's own older page cache at the limit and reuse those pages,
which stay backed. Durability is unchanged: pages are written back and fsynced exactly as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")


class PageCacheBound:
    """``with PageCacheBound(limit) as b:`` moves this process into a new memory cgroup of ``limit`` bytes
    (cgroup v1 or v2, as root), and out again and removes it on exit. ``b.description`` says what was done,
    or why the run is not bounded (no cgroup file system, no permission): the bench then runs as before."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.description = "not bounded"
        self._home: Path | None = None
        self._dir: Path | None = None

    def __enter__(self) -> PageCacheBound:
        if self.limit <= 0:
            self.description = "not bounded (--page-cache-gib 0)"
            return self
        try:
            self._enter()
        except OSError as e:
            self._leave()
            self.description = f"not bounded: {e}"
        return self

    def _enter(self) -> None:
        gib = self.limit / (1 << 30)
        name = f"moorage-bench-{os.getpid()}"
        own = _own_cgroups()
        if "memory" in own and (_V1 / "cgroup.procs").exists():
            home = _V1 / own["memory"].lstrip("/")
            self._home, self._dir = home, home / name
            self._dir.mkdir()
            (self._dir / "memory.limit_in_bytes").write_text(str(self.limit))
            kind = "v1"
        elif "" in own and "memory" in (_V2 / "cgroup.controllers").read_text().split():
            # v2: a cgroup with processes may not have children with controllers, so the new one goes under
            # the root, whose memory controller systemd enables for its own slices.
            self._home, self._dir = _V2 / own[""].lstrip("/"), _V2 / name
            self._dir.mkdir()
            (self._dir / "memory.max").write_text(str(self.limit))
            kind = "v2"
        else:
            raise OSError(0, "no memory cgroup controller", "/proc/self/cgroup")
        (self._dir / "cgroup.procs").write_text(str(os.getpid()))
        self.description = (f"memory cgroup ({kind}) of {gib:g} GiB around the bench, both savers' processes and the "
                            "PostgreSQL cluster: page cache is reclaimed and reused at the limit")

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._dir is None or not self._dir.exists():
            return
        try:
            # This process, and any it started that outlive the run (multiprocessing's resource tracker),
            # go back where they came from; the server's processes may still be exiting (an immediate
            # shutdown does not wait for them).
            deadline = time.monotonic() + 10
            while True:
                if self._home is not None:
                    for pid in [str(os.getpid())] + (self._dir / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            (self._home / "cgroup.procs").write_text(pid)
                try:
                    self._dir.rmdir()
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        except OSError as e:
            print(f"page cache: could not remove {self._dir}: {e}", file=sys.stderr)
        self._dir = None


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller name ("" for the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out
