"""The retention sweep of a backlog: how long a writer beside it waits for the tenant's write lock.

On a data directory a scale run kept (``run.py --keep``; stopped host), adds ``--spans`` spans older than their
TTL (copies of the store's own, 200 days back), deletes them as the code before the batching did (one
transaction) while a writer takes the lock every 50 ms, adds them again and sweeps them with this checkout's
``sweep_records`` (1,000 rows per transaction). Prints both: rows, seconds, the writer's longest wait.

    .venv/bin/python bench/scale/backlog.py /tmp/moorage-scale-XXXX/data [--spans 600000]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fill  # noqa: E402


def add_backlog(db: Path, n: int) -> None:
    con = sqlite3.connect(db, isolation_level=None)
    old = time.time() - 200 * 86400
    con.execute("BEGIN IMMEDIATE")
    con.execute(f"""INSERT INTO spans (trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, scope,
                                       user_id, agent_id)
        SELECT trace_id, span_id || '-' || k.v, parent_id, name, {old} - k.v * 3600 - start_ts % 3600, NULL, status,
               attrs, scope, user_id, agent_id
        FROM spans, (WITH RECURSIVE r(v) AS (SELECT 1 UNION ALL SELECT v + 1 FROM r WHERE v < 64) SELECT v FROM r) AS k
        LIMIT {n}""")
    con.execute("COMMIT")
    con.close()


def beside_a_writer(db: Path, label: str, sweep: Callable[[], int]) -> None:
    stop, waits = threading.Event(), []

    def writer() -> None:
        c = sqlite3.connect(db, isolation_level=None, timeout=600)
        while not stop.is_set():
            t0 = time.perf_counter()
            c.execute("BEGIN IMMEDIATE")
            waits.append(time.perf_counter() - t0)
            c.execute("COMMIT")
            time.sleep(0.05)
        c.close()

    th = threading.Thread(target=writer)
    th.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    n = sweep()
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    print(f"{label}: {n:,} rows in {took:.1f} s; a writer beside it waited at most {max(waits):.2f} s "
          f"({len(waits)} writes)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", type=Path)
    ap.add_argument("--spans", type=int, default=600_000)
    args = ap.parse_args()
    db = fill.tenant_db(args.data)
    add_backlog(db, args.spans)

    def one_transaction() -> int:
        con = sqlite3.connect(db, isolation_level=None, timeout=600)
        con.execute("PRAGMA secure_delete = ON")  # as the store opens it
        con.execute("BEGIN IMMEDIATE")
        n = con.execute("DELETE FROM spans WHERE start_ts < ?", (time.time() - 30 * 86400,)).rowcount
        con.execute("COMMIT")
        con.close()
        return n

    beside_a_writer(db, "one transaction (before)", one_transaction)
    add_backlog(db, args.spans)
    from moorage.store import Store
    from moorage.store.sqlite import SQLiteBackend

    store = Store(SQLiteBackend(args.data / "store"))
    ts = next(iter(store.operator.tenants()))
    beside_a_writer(db, "1,000 rows per transaction (this code)", lambda: ts.retention.sweep_records(time.time()))
    store.close()


if __name__ == "__main__":
    main()
