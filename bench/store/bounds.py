"""What limits a throughput cell, measured in the same run as the cell: CPU per put, and what SQLite itself
can gain from group commit when every saver writes the same bytes.

- ``cpu_now``: CPU seconds so far of this process (the savers and the writer threads) and of every
  PostgreSQL server process on the host. The difference over a sample, divided by its puts, is the CPU
  each put cost; with puts/s it says how much of the machine a cell used.
- ``sqlite_ceiling``: raw ``sqlite3`` from one thread, no LangGraph, no Python writer threads, with the
  durability of the bench (WAL, synchronous=FULL): puts/s when each transaction holds ``k`` rows of the
  size a peer writes per put. In mode ``full`` both SQLite savers write one such row per put (moorage
  keeps small channel values inline in its checkpoint row), so group commit can only save the
  per-transaction part of the cost: the ratio of k-row to 1-row transactions bounds what batching ``k``
  puts can gain over a saver that commits each put alone.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from pathlib import Path


def server_cpu_by() -> dict[str, float]:
    """CPU seconds per PostgreSQL process kind (backend of a database and role, walwriter, ...), from each
    process's scheduler statistics (nanoseconds on a CPU; /proc/PID/stat counts 10 ms ticks, too coarse for a
    sample of a few hundred milliseconds). Server processes are single-threaded."""
    total: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = Path(f"/proc/{pid}/cmdline").read_bytes()
            # Server processes only: the postmaster binary and its retitled children ("postgres: ..."). This
            # process's own command line may name "postgres" too (--backend postgres) and must not count.
            argv0 = comm.split(b"\0", 1)[0]
            if not (argv0.endswith(b"/postgres") or argv0.startswith(b"postgres:")) or int(pid) == os.getpid():
                continue
            ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        words = comm.replace(b"\0", b" ").decode(errors="replace").split()
        kind = " ".join(w for w in words[1:3] if "(" not in w) if words and words[0] == "postgres:" else "postmaster"
        total[kind] = total.get(kind, 0.0) + ns / 1e9
    return total


def cpu_now() -> tuple[float, float]:
    """(CPU seconds of this process, all threads, kernel time included; CPU seconds of all PostgreSQL server
    processes) so far."""
    return time.process_time(), sum(server_cpu_by().values())


def sqlite_ceiling(directory: Path, row_bytes: int, k: int, puts: int = 4000) -> float:
    """Puts/s of raw SQLite committing ``k`` rows of ``row_bytes`` per transaction (WAL, synchronous=FULL).

    The table has the peer's shape (a row per checkpoint, keyed by thread, namespace and id); rows go to
    ``k`` threads per transaction as ``k`` concurrent writers' puts would. A fresh file each call."""
    with tempfile.TemporaryDirectory(dir=directory, prefix="ceiling-") as d:
        conn = sqlite3.connect(str(Path(d) / "c.db"), isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("CREATE TABLE checkpoints (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, "
                         "checkpoint_id TEXT NOT NULL, checkpoint BLOB, metadata BLOB, "
                         "PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))")
            values = [os.urandom(row_bytes) for _ in range(8)]
            meta = b'{"source": "loop", "step": 1, "parents": {}}'
            batches = max(20, puts // k)
            # One unmeasured tenth first: the file and WAL exist at their working size before timing.
            warm = max(2, batches // 10)
            t0 = 0.0
            for b in range(warm + batches):
                if b == warm:
                    os.sync()
                    t0 = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                                 [(f"t{j}", "", f"{b:032d}", values[(b + j) % 8], meta) for j in range(k)])
                conn.execute("COMMIT")
            return batches * k / (time.perf_counter() - t0)
        finally:
            conn.close()
