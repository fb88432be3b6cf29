"""Async put throughput: N tasks of one event loop, each driving its own LangGraph thread with ``aput``.

moorage's ``MoorageSaver`` (the same instance the sync cells use) against ``AsyncSqliteSaver`` and
``AsyncPostgresSaver`` at the same durability as the sync cells. Each peer task gets its own saver (as the
sync bench gives each writer thread its own): ``AsyncSqliteSaver`` on its own ``aiosqlite`` connection (WAL,
synchronous=FULL), ``AsyncPostgresSaver`` on one shared ``AsyncConnectionPool`` with the documented
settings (autocommit, prepare_threshold=0, dict_row), opened anew for every cell.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable

import aiosqlite
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from contenders import versus
from report import section
from steps import Steps

#: The state sizes and mode of the async cells (a subset of the sync cells: the async path differs only in
#: how a write is queued and acknowledged).
ASYNC_SIZES = {"1KiB": 1024, "16KiB": 16 * 1024}
ASYNC_MODE = "full"


async def _rate(savers: Callable[[int], BaseCheckpointSaver], tag: str, size: int, tasks: int, per_task: int) -> float:
    """Puts/s of ``tasks`` concurrent tasks, each putting ``per_task`` checkpoints into its own thread id."""
    work = [[s.next() for _ in range(per_task)] for s in (Steps(size, ASYNC_MODE, i) for i in range(tasks))]

    async def run(i: int) -> None:
        saver = savers(i)
        config = {"configurable": {"thread_id": f"{tag}-t{i}", "checkpoint_ns": ""}}
        for cp, md, nv in work[i]:
            config = await saver.aput(config, cp, md, nv)

    t = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(tasks)))
    return tasks * per_task / (time.perf_counter() - t)


async def _cells(moorage: dict[str, BaseCheckpointSaver], tmp: Path, peer_pg_url: str, levels: tuple[int, ...],
                 per_task: int, rounds: int, warm_rounds: int, backends: list[str],
                 sizes: list[str]) -> list[dict[str, Any]]:
    conns: list[aiosqlite.Connection] = []
    pools: list[AsyncConnectionPool] = []

    async def fresh_pool() -> AsyncConnectionPool:
        # Opened anew per cell, as the sync bench does (contenders.py: a pool grown by an earlier 32-writer
        # cell made PostgresSaver's 8-writer cells about twice as costly per put).
        while pools:
            await pools.pop().close()
        pools.append(AsyncConnectionPool(peer_pg_url, min_size=1, max_size=max(10, max(levels)), open=False,
                                         kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}))
        await pools[0].open()
        pg_peers[:] = [AsyncPostgresSaver(pools[0]) for _ in range(max(levels))]
        return pools[0]

    pg_peers: list[AsyncPostgresSaver] = []
    try:
        await AsyncPostgresSaver(await fresh_pool()).setup()
        sqlite_peers: list[AsyncSqliteSaver] = []
        for _ in range(max(levels)):
            conn = await aiosqlite.connect(str(tmp / "async-peer.sqlite"), timeout=60)
            conns.append(conn)
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=FULL")
            sqlite_peers.append(AsyncSqliteSaver(conn))
        await sqlite_peers[0].setup()
        contenders: dict[str, list[tuple[str, Callable[[int], BaseCheckpointSaver]]]] = {
            "sqlite": [("moorage", lambda i: moorage["sqlite"]), ("AsyncSqliteSaver", sqlite_peers.__getitem__)],
            "postgres": [("moorage", lambda i: moorage["postgres"]), ("AsyncPostgresSaver", pg_peers.__getitem__)],
        }
        out = []
        for backend in backends:
            for size_name in sizes:
                size = ASYNC_SIZES[size_name]
                for tasks in levels:
                    if backend == "postgres":
                        await fresh_pool()
                    group = contenders[backend]
                    samples: dict[str, list[float]] = {name: [] for name, _ in group}
                    for rnd in range(warm_rounds):  # unmeasured, as large as a sample (connections, caches)
                        for name, savers in (group if rnd % 2 == 0 else group[::-1]):
                            await _rate(savers, f"awarm{tasks}r{rnd}-{backend}-{name}-{size_name}", size, tasks, per_task)
                    for rnd in range(rounds):
                        for name, savers in (group if rnd % 2 == 0 else group[::-1]):
                            os.sync()
                            samples[name].append(await _rate(savers, f"a{tasks}r{rnd}-{backend}-{name}-{size_name}", size,
                                                             tasks, per_task))
                    row = versus(samples, backend=backend, size=size_name, mode=ASYNC_MODE, tasks=tasks)
                    print(f"async {backend:8s} {size_name:6s} {tasks} tasks: moorage {row['moorage_per_s']:.0f} puts/s, "
                          f"{row['peer']} {row['peer_per_s']:.0f} ({row['ratio']:.2f}x)", flush=True)
                    out.append(row)
        return out
    finally:
        for conn in conns:
            await conn.close()
        while pools:
            await pools.pop().close()


def async_cells(moorage: dict[str, BaseCheckpointSaver], tmp: Path, peer_pg_url: str, levels: tuple[int, ...],
                per_task: int, rounds: int, warm_rounds: int, backends: list[str], sizes: list[str]) -> list[dict[str, Any]]:
    """Median puts/s of ``rounds`` samples per cell (moorage and its peer alternating, after ``warm_rounds``
    unmeasured ones), for each backend, size of ``ASYNC_SIZES`` and task count in ``levels``."""
    return asyncio.run(_cells(moorage, tmp, peer_pg_url, levels, per_task, rounds, warm_rounds, backends, sizes))


def async_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's section for the async cells."""
    if not rows:
        return []
    levels = sorted({r["tasks"] for r in rows})
    lines = section("Async throughput: puts/s from tasks of one event loop (`aput`, each task its own LangGraph thread)",
                    "Mode `full`. Peers: `AsyncSqliteSaver` (its own aiosqlite connection per task, WAL, synchronous=FULL) "
                    "and `AsyncPostgresSaver` (one saver per task on an `AsyncConnectionPool` opened anew per cell, "
                    "autocommit, prepare_threshold=0); moorage: the same `MoorageSaver` as above. Median of the rounds, "
                    "alternating, after warm-up rounds as large as a sample.",
                    ["backend", "size"]
                    + [c for t in levels for c in (f"moorage {t} tasks", f"peer {t} tasks", f"ratio {t} tasks")])
    for backend, size in dict.fromkeys((r["backend"], r["size"]) for r in rows):
        cells = []
        for t in levels:
            r = next(x for x in rows if (x["backend"], x["size"], x["tasks"]) == (backend, size, t))
            cells.append(f"{r['moorage_per_s']:.0f} | {r['peer_per_s']:.0f} | {r['ratio']:.2f}x")
        lines.append(f"| {backend} | {size} | " + " | ".join(cells) + " |")
    return lines


def async_headline(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    per = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        worst = min(r["ratio"] for r in rows if r["backend"] == backend)
        per.append(f"{backend} min {worst:.2f}x")
    return "async put throughput (" + ", ".join(dict.fromkeys(r["size"] for r in rows)) + " full, " + \
        "/".join(str(t) for t in sorted({r["tasks"] for r in rows})) + " tasks): " + ", ".join(per)
