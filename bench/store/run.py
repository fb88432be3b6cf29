"""Store bench: durable LangGraph checkpoint put/get latency and throughput, moorage vs the official savers,
plus compare-and-set under multi-process contention. Run: ``.venv/bin/python bench/store/run.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import cpu_now, server_cpu_by, sqlite_ceiling  # noqa: E402
from cas import run_cas  # noqa: E402
from contenders import Contender, open_contenders, peer_versions  # noqa: E402
from asyncbench import ASYNC_SIZES, async_cells, async_headline, async_lines  # noqa: E402
from pagecache import PageCacheBound  # noqa: E402
from report import section  # noqa: E402
from pgceiling import SECONDS as PG_CEILING_SECONDS, ceiling_headline, ceiling_lines, pg_ceiling  # noqa: E402
from scaling import SCALING_LEVELS, SCALING_MODE, SCALING_PUTS, SCALING_SIZE, scaling_headline, scaling_lines, sweep  # noqa: E402
from steps import Steps  # noqa: E402

from moorage.devservices.postgres import start_cluster  # noqa: E402
from moorage.store import Store  # noqa: E402
from moorage.store.postgres import PostgresBackend  # noqa: E402
from moorage.store.sqlite import SQLiteBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"
SIZES = {"1KiB": 1024, "16KiB": 16 * 1024, "256KiB": 256 * 1024}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(xs, 0.5) * 1e3, "p99_ms": _pct(xs, 0.99) * 1e3, "min_ms": min(xs) * 1e3,
            "max_ms": max(xs) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3}


def sequential(saver: BaseCheckpointSaver, thread: str, size: int, mode: str, n: int) -> dict[str, Any]:
    # Unmeasured first: a connection just opened (the peer's pool is reset before this) and first-use
    # statement preparation would otherwise land in the first put, get and list.
    warm = Steps(size, mode, n + 1)
    wcfg = {"configurable": {"thread_id": f"{thread}-warm", "checkpoint_ns": ""}}
    for _ in range(SEQ_WARM):
        cp, md, nv = warm.next()
        wcfg = saver.put(wcfg, cp, md, nv)
    saver.get_tuple(wcfg)
    list(saver.list(wcfg, limit=LIST_LIMIT))
    steps = Steps(size, mode, n)
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    puts, gets = [], []
    for _ in range(n):
        cp, md, nv = steps.next()
        t = time.perf_counter()
        config = saver.put(config, cp, md, nv)
        puts.append(time.perf_counter() - t)
    latest = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for _ in range(n):
        t = time.perf_counter()
        tup = saver.get_tuple(latest)
        gets.append(time.perf_counter() - t)
    assert tup is not None and tup.checkpoint["channel_values"] == steps.values, "read back a different state"
    # The thread's history as LangGraph's get_state_history reads it (thread and namespace, newest first).
    lists = []
    want = min(n, LIST_LIMIT)
    for _ in range(max(9, n // 10)):
        t = time.perf_counter()
        listed = list(saver.list(latest, limit=LIST_LIMIT))
        lists.append(time.perf_counter() - t)
    assert len(listed) == want and listed[0].checkpoint["channel_values"] == steps.values, "listed a different history"
    return {"put": _summary(puts), "get": _summary(gets), "list": {**_summary(lists), "checkpoints": want},
            "put_per_s": n / sum(puts), "get_per_s": n / sum(gets)}


#: Unmeasured rounds per contender before a throughput cell's samples, each as large as a sample. Until
#: session 9 it was one round of a fifth of a sample; PostgresSaver was still warming up in the first
#: samples after it (1 KiB `full`, 8 writers: 4,050 and 4,776 puts/s in the first sample after settling,
#: 6,200-8,300 from the second on, its client CPU per put falling from 0.20-0.31 to 0.12-0.15 ms), which
#: lowered its median and flattered moorage.
WARM_ROUNDS = 2

#: Checkpoints per ``list`` in the sequential measurement (at most; fewer where fewer were put).
LIST_LIMIT = 100
#: Unmeasured puts (then a get and a list) on another thread id before the sequential measurement.
SEQ_WARM = 5


def ceiling(tmp: Path, size_name: str, size: int, levels: tuple[int, ...]) -> dict[str, Any]:
    """SQLite's own gain from batching at equal bytes (``bounds.sqlite_ceiling``) for mode ``full`` at ``size``:
    rows of the size SqliteSaver writes per put, one per transaction and ``w // 2`` per transaction (with
    ``w`` writers, group commit's batches alternate between two halves). Median of 3 rounds, orders
    alternating."""
    cp = Steps(size, "full", 0).next()[0]
    row = len(JsonPlusSerializer().dumps_typed(cp)[1])
    ks = [1] + [max(1, w // 2) for w in levels]
    puts = 4000 if size < 256 * 1024 else 400
    runs: dict[int, list[float]] = {k: [] for k in ks}
    for rnd in range(3):
        for k in (ks if rnd % 2 == 0 else ks[::-1]):
            runs[k].append(sqlite_ceiling(tmp, row, k, puts))
    per_s = {str(k): statistics.median(v) for k, v in runs.items()}
    print(f"sqlite ceiling {size_name}: row {row} bytes, " + ", ".join(f"{k} per tx {v:.0f} puts/s" for k, v in per_s.items()),
          flush=True)
    return {"size": size_name, "row_bytes": row, "per_s": per_s, "samples": {str(k): v for k, v in runs.items()},
            "batch_for_level": {str(w): str(max(1, w // 2)) for w in levels}}


def concurrent(c: Contender, tag: str, size: int, mode: str, workers: int, per_worker: int) -> float:
    """Puts/s with ``workers`` threads, each driving its own LangGraph thread id."""
    savers = [c.saver_for(i) for i in range(workers)]
    steps = [Steps(size, mode, i) for i in range(workers)]
    barrier = threading.Barrier(workers + 1)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        config = {"configurable": {"thread_id": f"{tag}-w{i}", "checkpoint_ns": ""}}
        work = [steps[i].next() for _ in range(per_worker)]
        barrier.wait()
        try:
            for cp, md, nv in work:
                config = savers[i].put(config, cp, md, nv)
        except BaseException as e:  # surfaced below: a failed put must fail the bench
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return workers * per_worker / wall


def settle(cluster: Any, sqlite_files: list[Path], databases: list[str]) -> None:
    """Start every cell from the same quiet state for all contenders: earlier cells' WAL checkpointed into
    the SQLite files, the PostgreSQL tables vacuumed and analysed (so autovacuum has nothing pending) and
    checkpointed, and all dirty pages written back. Without it, the previous cell's writeback and
    autovacuum ran during the next cell's first samples (measured: a cell's first 8-writer round right
    after a 32-writer one at ~65% of the following rounds' rate, on both savers)."""
    for f in sqlite_files:
        conn = sqlite3.connect(str(f), timeout=60)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
    for db in databases:
        cluster.psql("VACUUM (ANALYZE)", db=db)
    cluster.psql("CHECKPOINT")
    os.sync()


def durability_settings(tmp: Path, pg_store: Store) -> dict[str, str]:
    conn = sqlite3.connect(str(tmp / "peer.sqlite"))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    peer = f"journal_mode={conn.execute('PRAGMA journal_mode').fetchone()[0]}, synchronous={conn.execute('PRAGMA synchronous').fetchone()[0]} (2=FULL)"
    conn.close()
    return {"SqliteSaver": peer, "postgresql (both savers, same cluster)": pg_store.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ", ".join(SIZES))
    ap.add_argument("--backends", default="sqlite,postgres", help="comma-separated subset of sqlite, postgres")
    ap.add_argument("--page-cache-gib", type=float, default=4.0,
                    help="memory cgroup limit around the run, see pagecache.py (0: unbounded)")
    args = ap.parse_args()
    with PageCacheBound(int(args.page_cache_gib * (1 << 30))) as bound:
        print(f"page cache: {bound.description}", flush=True)
        _run(args, bound.description)


def _run(args: argparse.Namespace, page_cache: str) -> None:
    n = 60 if args.quick else 300
    # Throughput is measured at each writer-thread count; the first is the headline's.
    levels, per_worker = ((4,), 20) if args.quick else ((8, 32), 150)
    rounds = 1 if args.quick else 5
    workers = levels[0]
    cas_procs, cas_incs = (4, 25) if args.quick else (4, 100)
    modes = ("full", "one")
    scale_levels, scale_puts = ((1, 4), SCALING_PUTS // 10) if args.quick else (SCALING_LEVELS, SCALING_PUTS)

    report: dict[str, Any] = {"settings": {"quick": args.quick, "sequential_n": n, "workers": workers,
                                           "worker_levels": list(levels),
                                           "puts_per_worker": per_worker, "throughput_rounds": rounds, "warm_rounds": WARM_ROUNDS, "cas_processes": cas_procs,
                                           "cas_increments": cas_incs, "scaling_levels": list(scale_levels),
                                           "scaling_puts": scale_puts, "python": platform.python_version(),
                                           "sqlite": sqlite3.sqlite_version, "cpus": os.cpu_count(),
                                           "page_cache": page_cache},
                              "versions": peer_versions(), "checkpoints": [], "cas": [], "ceiling": [], "async": [], "scaling": []}
    cluster = start_cluster()
    try:
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="moorage-bench-") as tmpd:
            tmp = Path(tmpd)
            urls: dict[str, str] = {}

            def pg_url(name: str) -> str:
                if name not in urls:
                    urls[name] = cluster.create_database(name)
                return urls[name]

            contenders = open_contenders(stack, tmp, pg_url, max(*levels, *scale_levels))
            pg_store = stack.enter_context(Store(PostgresBackend(pg_url("moorage_bench"), pool_size=1)))
            report["durability"] = durability_settings(tmp, pg_store)
            report["durability"]["moorage sqlite"] = contenders[0].saver_for(0).tenant_store._backend.describe()
            mts = contenders[0].saver_for(0).tenant_store
            sqlite_files = [tmp / "peer.sqlite", mts.backend.tenant_path(mts.tenant_id)]
            # One backend at a time: PostgreSQL's background work (checkpointer, autovacuum) must not land
            # in the SQLite samples, nor SQLite's writeback in PostgreSQL's.
            for backend in ("sqlite", "postgres"):
                if backend not in args.backends.split(","):
                    continue
                group = [c for c in contenders if c.backend == backend]
                for size_name, size in SIZES.items():
                    if size_name not in args.sizes.split(","):
                        continue
                    reps = max(10, n // 4) if size >= 256 * 1024 else n
                    per_w = max(5, per_worker // 4) if size >= 256 * 1024 else per_worker
                    for mode in modes:
                        # Throughput: ``rounds`` short samples per contender and writer count, moorage and its
                        # peer alternating (order flipped every round) so a burst of load from elsewhere on
                        # this shared host hits both alike; the median is reported, every sample is kept.
                        samples: dict[int, dict[str, list[float]]] = {id(c): {str(w): [] for w in levels} for c in group}
                        # CPU ms per put of each sample: (this process, PostgreSQL server processes), and the
                        # server's by process kind (a backend, autovacuum, the checkpointer, ...).
                        cpu: dict[int, dict[str, list[tuple[float, float]]]] = {id(c): {str(w): [] for w in levels} for c in group}
                        server_by: dict[int, dict[str, list[dict[str, float]]]] = {id(c): {str(w): [] for w in levels}
                                                                                   for c in group}
                        for w in levels:
                            settle(cluster, sqlite_files, list(urls))
                            for c in group:
                                c.reset()
                            # Unmeasured full-size rounds first (see WARM_ROUNDS): connections (the peer's pool
                            # opens them on demand), prepared statements and caches are warm before anything counts.
                            for rnd in range(WARM_ROUNDS):
                                for c in (group if rnd % 2 == 0 else group[::-1]):
                                    concurrent(c, f"warm{w}r{rnd}-{c.backend}-{c.name}-{size_name}-{mode}", size, mode,
                                               w, per_w)
                            for rnd in range(rounds):
                                for c in (group if rnd % 2 == 0 else group[::-1]):
                                    tag = f"{c.backend}-{c.name}-{size_name}-{mode}"
                                    # The previous sample's dirty pages are written back first, so no contender's
                                    # sample pays for its predecessor's writeback.
                                    os.sync()
                                    before, kinds0 = cpu_now(), server_cpu_by()
                                    samples[id(c)][str(w)].append(concurrent(c, f"conc{w}r{rnd}-{tag}", size, mode, w, per_w))
                                    after, kinds1 = cpu_now(), server_cpu_by()
                                    cpu[id(c)][str(w)].append(tuple((b - a) / (w * per_w) * 1e3 for a, b in zip(before, after)))
                                    server_by[id(c)][str(w)].append(
                                        {k: round((v - kinds0.get(k, 0.0)) / (w * per_w) * 1e3, 4) for k, v in kinds1.items()
                                         if v - kinds0.get(k, 0.0) > 0})
                        for c in group:
                            tag = f"{c.backend}-{c.name}-{size_name}-{mode}"
                            # One writer: the peer's pool as one writer would have it, not as the 32-writer
                            # samples just grew it (until session 10 its sequential puts and gets went through
                            # every connection of that pool in turn; see contenders.py).
                            c.reset()
                            os.sync()
                            seq = sequential(c.saver_for(0), f"seq-{tag}", size, mode, reps)
                            thr = {w: statistics.median(xs) for w, xs in samples[id(c)].items()}
                            row = {"saver": c.name, "backend": c.backend, "size": size_name, "mode": mode, **seq,
                                   "concurrent_put_per_s": thr[str(workers)], "concurrent": thr,
                                   "concurrent_samples": samples[id(c)], "setup": c.settings,
                                   "cpu_ms_per_put": {w: [statistics.median(x[i] for x in xs) for i in (0, 1)]
                                                      for w, xs in cpu[id(c)].items()},
                                   "cpu_samples": cpu[id(c)], "server_cpu_by_kind": server_by[id(c)]}
                            report["checkpoints"].append(row)
                            print(f"{c.backend:8s} {c.name:13s} {size_name:6s} {mode:4s} put p50 {seq['put']['p50_ms']:.2f} ms "
                                  f"p99 {seq['put']['p99_ms']:.2f} | get p50 {seq['get']['p50_ms']:.2f} ms | "
                                  f"list p50 {seq['list']['p50_ms']:.2f} ms | "
                                  + ", ".join(f"{w} writers {r:.0f} puts/s" for w, r in thr.items()), flush=True)
                    if backend == "sqlite":
                        report["ceiling"].append(ceiling(tmp, size_name, size, levels))
                if SCALING_SIZE in args.sizes.split(","):
                    # Each saver's puts/s from 1 to 64 writers, and its best (see scaling.py).
                    def measure(c: Contender, tag: str, w: int, per_w: int) -> float:
                        os.sync()
                        return concurrent(c, tag, SIZES[SCALING_SIZE], SCALING_MODE, w, per_w)

                    def prepare(group: list[Contender] = group) -> None:
                        settle(cluster, sqlite_files, list(urls))
                        for c in group:
                            c.reset()

                    report["scaling"] += sweep(group, measure, prepare, scale_levels, scale_puts, rounds, WARM_ROUNDS)
                if backend == "postgres" and "1KiB" in args.sizes.split(","):
                    # What any client reaches here: pgbench on the same cluster (see pgceiling.py).
                    def open_tenant(name: str) -> str:
                        s = stack.enter_context(Store(PostgresBackend(pg_url(name), pool_size=1)))
                        return s.operator.create_tenant("ceiling")[0].id

                    settle(cluster, sqlite_files, list(urls))
                    report["pg_ceiling"] = pg_ceiling(cluster, pg_url, open_tenant, levels, 1 if args.quick else 2,
                                                      1 if args.quick else PG_CEILING_SECONDS)
            # Async: tasks of one event loop through aput, the same moorage savers against the async peers.
            backends = [b for b in ("sqlite", "postgres") if b in args.backends.split(",")]
            sizes = [z for z in args.sizes.split(",") if z in ASYNC_SIZES]
            if backends and sizes:
                moorage = {c.backend: c.saver_for(0) for c in contenders if c.name == "moorage"}
                async_levels, per_task, async_rounds = ((4,), 20, 1) if args.quick else ((8, 32), 100, 3)
                report["settings"].update({"async_task_levels": list(async_levels), "async_puts_per_task": per_task,
                                           "async_rounds": async_rounds})
                report["async"] = async_cells(moorage, tmp, pg_url("async_peer_bench"), async_levels, per_task,
                                              async_rounds, WARM_ROUNDS, backends, sizes)
            # CAS contention through the store API, one store per process.
            for kind in ("sqlite", "postgres"):
                if kind == "sqlite":
                    where = str(tmp / "cas-store")
                    s = Store(SQLiteBackend(Path(where)))
                else:
                    where = pg_url("cas_bench")
                    s = Store(PostgresBackend(where, pool_size=1))
                _, key = s.operator.create_tenant("cas")
                s.close()
                r = run_cas(kind, where, key.secret, cas_procs, cas_incs)
                report["cas"].append({**r.__dict__, "increments_per_s": r.per_s})
                print(f"CAS {kind}: {r.processes} procs x {r.increments} -> final {r.final}, lost {r.lost_updates}, "
                      f"retries {r.retries}, {r.per_s:.0f} increments/s", flush=True)
    finally:
        cluster.stop()
    write_report(report)


def _row(rows: list[dict], backend: str, saver: str, size: str, mode: str) -> dict:
    return next(r for r in rows if r["backend"] == backend and r["saver"] == saver and r["size"] == size and r["mode"] == mode)


def write_report(report: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = report["checkpoints"]
    peers = {"sqlite": "SqliteSaver", "postgres": "PostgresSaver"}
    levels = [str(w) for w in report["settings"]["worker_levels"]]
    ratios = []
    for r in rows:
        if r["saver"] != "moorage":
            continue
        peer = peers[r["backend"]]
        p = _row(rows, r["backend"], peer, r["size"], r["mode"])
        ratios.append({"backend": r["backend"], "size": r["size"], "mode": r["mode"], "peer": peer,
                       "seq_put": r["put_per_s"] / p["put_per_s"], "seq_get": r["get_per_s"] / p["get_per_s"],
                       "list": p["list"]["p50_ms"] / r["list"]["p50_ms"],
                       "concurrent_put": r["concurrent_put_per_s"] / p["concurrent_put_per_s"],
                       "concurrent": {w: r["concurrent"][w] / p["concurrent"][w] for w in levels},
                       # Conservative: moorage's median against the peer's fastest sample.
                       "concurrent_vs_best": {w: r["concurrent"][w] / max(p["concurrent_samples"][w]) for w in levels}})
    report["ratios"] = ratios
    (OUT / "store.json").write_text(json.dumps(report, indent=2))

    s = report["settings"]
    lines = ["# Store bench: durable LangGraph checkpoints and compare-and-set", "",
             f"Settings: quick={s['quick']}, sequential puts/gets per case={s['sequential_n']} (¼ of that at 256 KiB), "
             f"{' and '.join(levels)} writer threads x {s['puts_per_worker']} puts each (¼ at 256 KiB), "
             f"median of {s.get('throughput_rounds', 1)} rounds per throughput cell (moorage and peer alternating, "
             f"after {s.get('warm_rounds', 1)} unmeasured warm-up rounds each; every cell starts from checkpointed, vacuumed, synced files, "
             "PostgresSaver's connection pool opened anew, and every sample after a sync), "
             f"CAS {s['cas_processes']} processes x {s['cas_increments']} increments; Python {s['python']}, "
             f"SQLite {s['sqlite']}, {s['cpus']} CPUs (shared: timings are noisy, compare within one run).", "",
             f"Page cache: {s.get('page_cache', 'not bounded')} (why: bench/store/pagecache.py).", "",
             "Durability (equal for every contender: an acknowledged write is on disk):", ""]
    lines += [f"- {k}: {v}" for k, v in report["durability"].items()]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
              "State: four channels sharing the size; mode `full` rewrites all four each step, `one` rewrites one.", "",
              "## Throughput: concurrent puts/s (each writer thread drives its own LangGraph thread)", "",
              "| backend | size | mode | " + " | ".join(f"moorage {w}w | peer {w}w | ratio {w}w" for w in levels) + " |",
              "|---|---|---|" + "---|---|---|" * len(levels)]
    for q in ratios:
        m = _row(rows, q["backend"], "moorage", q["size"], q["mode"])
        p = _row(rows, q["backend"], q["peer"], q["size"], q["mode"])
        cells = " | ".join(f"{m['concurrent'][w]:.0f} | {p['concurrent'][w]:.0f} | {q['concurrent'][w]:.2f}x" for w in levels)
        lines.append(f"| {q['backend']} | {q['size']} | {q['mode']} | {cells} |")
    lines += async_lines(report.get("async", []))
    lines += scaling_lines(report.get("scaling", []))
    lines += _spread_lines(rows, ratios, levels)
    lines += _cpu_lines(rows, ratios, levels, s["cpus"])
    lines += _ceiling_lines(report.get("ceiling", []), ratios, levels)
    lines += ceiling_lines(report.get("pg_ceiling", []), rows)
    lines += ["", "## Latency: one writer, sequential puts then gets of the latest checkpoint, then lists of the history", "",
              "Each put waits for its own commit and fsync, on every saver: this is latency, not throughput. A list reads "
              f"the thread's newest {LIST_LIMIT} checkpoints (fewer where fewer were put: ¼ at 256 KiB) with their values "
              "and pending writes, as LangGraph's `get_state_history` does.", "",
              "| backend | saver | size | mode | put p50 ms | put p99 ms | put min–max ms | get p50 ms | get p99 ms | "
              "list p50 ms | seq puts/s | seq gets/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, g = r["put"], r["get"]
        lines.append(f"| {r['backend']} | {r['saver']} | {r['size']} | {r['mode']} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} | "
                     f"{p['min_ms']:.2f}–{p['max_ms']:.2f} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} | {r['list']['p50_ms']:.2f} | "
                     f"{r['put_per_s']:.0f} | {r['get_per_s']:.0f} |")
    lines += ["", "Ratios moorage / peer (higher is better for moorage; list: the peer's time over moorage's):", "",
              "| backend | size | mode | peer | sequential put | get | list | "
              + " | ".join(f"concurrent put {w}w" for w in levels) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(levels)]
    for q in ratios:
        lines.append(f"| {q['backend']} | {q['size']} | {q['mode']} | {q['peer']} | {q['seq_put']:.2f}x | {q['seq_get']:.2f}x | "
                     f"{q['list']:.2f}x | " + " | ".join(f"{q['concurrent'][w]:.2f}x" for w in levels) + " |")
    lines += ["", "| CAS backend | processes x increments | final | lost updates | retries | increments/s |", "|---|---|---|---|---|---|"]
    for c in report["cas"]:
        lines.append(f"| {c['backend']} | {c['processes']} x {c['increments']} | {c['final']} | {c['lost_updates']} | "
                     f"{c['retries']} | {c['increments_per_s']:.0f} |")
    headline = _headline(ratios, report["cas"], levels, async_headline(report.get("async", [])),
                         scaling_headline(report.get("scaling", [])), ceiling_headline(report.get("pg_ceiling", []), rows))
    lines += ["", headline, ""]
    (OUT / "store.md").write_text("\n".join(lines))
    print(f"report: {OUT / 'store.md'}")
    print(headline)


#: A cell's samples of one saver spread "wide" when the fastest is this many times the slowest.
WIDE_SPREAD = 1.5


def _spread_lines(rows: list[dict], ratios: list[dict], levels: list[str]) -> list[str]:
    """Cells where either saver's samples spread widely, with the ratio against the peer's fastest sample: a
    median taken while a saver swings between a fast and a slow state says little on its own."""
    wide = []
    for q in ratios:
        m = _row(rows, q["backend"], "moorage", q["size"], q["mode"])
        p = _row(rows, q["backend"], q["peer"], q["size"], q["mode"])
        for w in levels:
            ms, ps = m["concurrent_samples"][w], p["concurrent_samples"][w]
            if max(ms) > WIDE_SPREAD * min(ms) or max(ps) > WIDE_SPREAD * min(ps):
                wide.append(f"| {q['backend']} | {q['size']} | {q['mode']} | {w} | {min(ms):.0f}–{max(ms):.0f} | "
                            f"{min(ps):.0f}–{max(ps):.0f} | {q['concurrent'][w]:.2f}x | {q['concurrent_vs_best'][w]:.2f}x |")
    if not wide:
        return []
    return section("Throughput cells whose samples spread widely",
                   f"Cells where a saver's fastest sample was more than {WIDE_SPREAD}x its slowest (this host is shared "
                   "and `PostgresSaver` at 8 writers sometimes runs whole samples at about half its rate, with about "
                   "twice the client CPU per put): the ratio of the medians as above, and moorage's median against "
                   "the peer's fastest sample, the conservative reading.",
                   ["backend", "size", "mode", "writers", "moorage samples", "peer samples", "median ratio",
                    "against peer's best"]) + wide


def _cpu_lines(rows: list[dict], ratios: list[dict], levels: list[str], cpus: int) -> list[str]:
    """CPU per put of each throughput cell, and the cores that makes at the cell's rate (the host has few)."""
    if not all("cpu_ms_per_put" in r for r in rows):
        return []

    def cell(r: dict, w: str) -> str:
        client, server = r["cpu_ms_per_put"][w]
        cores = (client + server) / 1e3 * r["concurrent"][w]
        return (f"{client:.3f} + {server:.3f}" if r["backend"] == "postgres" else f"{client:.3f}") + f" ({cores:.1f})"

    lines = section("CPU per put in the throughput cells",
                    "Milliseconds of CPU per put, median of the rounds: this process (saver, serialisation, writer "
                    "threads; kernel time included) and, on PostgreSQL, + the server processes; in brackets the cores "
                    "that is at the cell's rate. A cell whose peer already uses about every core can only be beaten by "
                    "using less CPU per put.",
                    ["backend", "size", "mode"] + [f"{who} {w}w" for w in levels for who in ("moorage", "peer")])
    for q in ratios:
        m = _row(rows, q["backend"], "moorage", q["size"], q["mode"])
        p = _row(rows, q["backend"], q["peer"], q["size"], q["mode"])
        lines.append(f"| {q['backend']} | {q['size']} | {q['mode']} | "
                     + " | ".join(f"{cell(m, w)} | {cell(p, w)}" for w in levels) + " |")
    return lines + _cpu_bound_lines(rows, ratios, levels, cpus)


def _cpu_bound_lines(rows: list[dict], ratios: list[dict], levels: list[str], cpus: int) -> list[str]:
    """For each cell under 2x: the most moorage's measured CPU per put allows on this host's cores."""
    out = []
    for q in ratios:
        for w in levels:
            if q["concurrent"][w] >= 2.0:
                continue
            m = _row(rows, q["backend"], "moorage", q["size"], q["mode"])
            p = _row(rows, q["backend"], q["peer"], q["size"], q["mode"])
            per_put = sum(m["cpu_ms_per_put"][w])
            leanest = min(sum(x) for x in m["cpu_samples"][w])
            busy = per_put / 1e3 * m["concurrent"][w]
            out.append(f"- {q['backend']} {q['size']} {q['mode']}, {w} writers: moorage's median {m['concurrent'][w]:.0f} "
                       f"puts/s used {per_put:.3f} ms of CPU per put, {busy:.1f} of {cpus} cores; with all {cpus} busy "
                       f"that CPU per put allows at most {cpus / per_put * 1e3:.0f} puts/s, its leanest sample's "
                       f"({leanest:.3f} ms) {cpus / leanest * 1e3:.0f}. 2x the peer's median is {2 * p['concurrent'][w]:.0f}.")
    if not out:
        return out
    return ["", f"Cells under 2x, against the cores: a rate above {cpus} cores / (CPU per put) cannot be reached "
            "with that CPU per put, however the work is arranged. Where that bound is above 2x the peer, the cores "
            "are not what holds the cell back (on SQLite: one writer at a time per file).", ""] + out


def _ceiling_lines(ceilings: list[dict], ratios: list[dict], levels: list[str]) -> list[str]:
    """SQLite's own gain from batching at equal bytes, next to what moorage measured over its peer."""
    if not ceilings:
        return []
    lines = section("SQLite: what batching alone can gain when both savers write the same bytes",
                    "In mode `full` each put of either saver is one row of the serialised state (moorage keeps small "
                    "channel values inline in its checkpoint row), written to the WAL and again at the WAL checkpoint; "
                    "group commit saves only each transaction's fixed part (its fsync). Raw `sqlite3` from one thread, "
                    "no LangGraph and no writer threads, WAL + synchronous=FULL: rows of the size SqliteSaver writes, 1 "
                    "per transaction (as the peer commits) and k per transaction (the batch each half of the writers "
                    "forms). Median of 3.",
                    ["size", "row bytes", "raw 1/tx puts/s"]
                    + [c for w in levels for c in (f"raw k/tx for {w}w", "batching gain", f"moorage/peer full {w}w")])
    for c in ceilings:
        q = next((q for q in ratios if q["backend"] == "sqlite" and q["size"] == c["size"] and q["mode"] == "full"), None)
        one = c["per_s"]["1"]
        cells = []
        for w in levels:
            k = c["batch_for_level"][w]
            cells.append(f"k={k}: {c['per_s'][k]:.0f} | {c['per_s'][k] / one:.2f}x | "
                         + (f"{q['concurrent'][w]:.2f}x" if q else "-"))
        lines.append(f"| {c['size']} | {c['row_bytes']} | {one:.0f} | " + " | ".join(cells) + " |")
    return lines


def _under(ratio: float) -> str:
    """A ratio under the 2x target, with enough digits not to print as 2.00."""
    text = f"{ratio:.2f}"
    return f"{ratio:.3f}" if text == "2.00" else text


def _headline(ratios: list[dict], cas: list[dict], levels: list[str], async_part: str = "", scaling_part: str = "",
              ceiling_part: str = "") -> str:
    """Throughput first: the worst cell per backend and every cell under the 2x target, by name."""
    parts = []
    backends = [b for b in ("sqlite", "postgres") if any(q["backend"] == b for q in ratios)]  # --backends
    for w in levels:
        per = []
        for backend in backends:
            qs = [q for q in ratios if q["backend"] == backend]
            worst = min(q["concurrent"][w] for q in qs)
            below = [f"{q['size']} {q['mode']} {_under(q['concurrent'][w])}x" for q in qs if q["concurrent"][w] < 2.0]
            per.append(f"{backend} min {_under(worst) if worst < 2.0 else format(worst, '.2f')}x" + (f" (below 2x: {', '.join(below)})" if below else " (all >= 2x)"))
        parts.append(f"{w} writers: " + "; ".join(per))
    # Conservative: the worst of moorage's median against the peer's fastest sample, per writer count and backend.
    best = []
    for w in levels:
        worst = {b: min(q["concurrent_vs_best"][w] for q in ratios if q["backend"] == b) for b in backends}
        best.append(f"{w} writers " + ", ".join(f"{b} min {v:.2f}x" for b, v in worst.items()))

    def med(backend: str, key: str) -> float:
        return statistics.median(q[key] for q in ratios if q["backend"] == backend)

    lost = "/".join(str(c["lost_updates"]) for c in cas)
    cas_rate = "/".join(f"{c['increments_per_s']:.0f}" for c in cas)
    put = " ".join(f"{b} {med(b, 'seq_put'):.2f}x" for b in backends)
    get = " ".join(f"{b} {med(b, 'seq_get'):.2f}x" for b in backends)
    lst = " ".join(f"{b} {med(b, 'list'):.2f}x" for b in backends)
    return ("concurrent put throughput moorage/peer per size and mode, " + " | ".join(parts)
            + f"; against the peer's fastest sample (conservative): {' | '.join(best)}"
            + (f". {async_part[0].upper()}{async_part[1:]}" if async_part else "")
            + (f". {scaling_part[0].upper()}{scaling_part[1:]}" if scaling_part else "")
            + (f". {ceiling_part}" if ceiling_part else "")
            + f". Sequential (latency-bound, median): put {put}, get {get}, list {lst}; "
            f"CAS lost updates {lost} (sqlite/postgres) at {cas_rate} inc/s")


if __name__ == "__main__":
    main()
