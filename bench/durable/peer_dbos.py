"""DBOS peer for the durable-step bench: one process per configuration (DBOS is a per-process singleton).

Usage: python peer_dbos.py DB_PATH WORKFLOWS STEPS MODE JOURNAL   (MODE sync|async, JOURNAL default|wal)
Prints one JSON object: per-step latencies (seconds) and the wall time of the whole batch.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import sys
import time

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig

DB, WORKFLOWS, STEPS, MODE, JOURNAL = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
lat: list[float] = []

if JOURNAL == "wal":
    # Same settings as moorage's SQLite store: WAL, fsync of the WAL at every commit.
    @sa.event.listens_for(sa.engine.Engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA synchronous=FULL")


@DBOS.step()
def step_sync(i: int) -> int:
    return i


@DBOS.workflow()
def wf_sync(n: int) -> int:
    total = 0
    for i in range(n):
        t = time.perf_counter()
        total += step_sync(i)
        lat.append(time.perf_counter() - t)
    return total


@DBOS.step()
async def step_async(i: int) -> int:
    return i


@DBOS.workflow()
async def wf_async(n: int) -> int:
    total = 0
    for i in range(n):
        t = time.perf_counter()
        total += await step_async(i)
        lat.append(time.perf_counter() - t)
    return total


def main() -> None:
    config: DBOSConfig = {"name": "durable-bench", "system_database_url": f"sqlite:///{DB}", "log_level": "ERROR"}
    DBOS(config=config)
    DBOS.launch()
    t0 = time.perf_counter()
    if MODE == "sync":
        for _ in range(WORKFLOWS):
            assert wf_sync(STEPS) == STEPS * (STEPS - 1) // 2
    else:
        async def go() -> None:
            for _ in range(WORKFLOWS):
                assert await wf_async(STEPS) == STEPS * (STEPS - 1) // 2
        asyncio.run(go())
    wall = time.perf_counter() - t0
    with sa.create_engine(f"sqlite:///{DB}").connect() as c:
        journal_mode = c.execute(sa.text("PRAGMA journal_mode")).scalar()
        synchronous = c.execute(sa.text("PRAGMA synchronous")).scalar()
    DBOS.destroy()
    print(json.dumps({"lat": lat, "wall": wall, "version": importlib.metadata.version("dbos"),
                      "journal_mode": journal_mode, "synchronous": synchronous}))


if __name__ == "__main__":
    main()
