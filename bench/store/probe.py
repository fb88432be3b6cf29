"""Probe one concurrent-put cell: puts/s plus CPU seconds per put in this process and in the PostgreSQL server.

``.venv/bin/python bench/store/probe.py [--backend postgres|sqlite] [--size 1KiB] [--mode full] [--workers 8] [--n 60] [--reps 3]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import server_cpu_by  # noqa: E402
from contenders import open_contenders  # noqa: E402
from pagecache import PageCacheBound  # noqa: E402
from run import SIZES, concurrent  # noqa: E402

from moorage.devservices.postgres import PostgresCluster, start_cluster  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="postgres")
    ap.add_argument("--size", default="1KiB")
    ap.add_argument("--mode", default="full")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--inline-max", type=int, default=-1, help="override MoorageSaver's inline_max (and inline_total x4)")
    ap.add_argument("--log-min", type=int, default=-1, help="override MoorageSaver's log_min (SQLite blob log threshold)")
    ap.add_argument("--inflight", type=int, default=0, help="override GroupCommit's transactions in flight")
    ap.add_argument("--extra-min", type=int, default=0, help="override GroupCommit's queue length for a second transaction")
    ap.add_argument("--prefill", type=int, default=0,
                    help="first put this many checkpoints per writer into every contender (as earlier cells do)")
    ap.add_argument("--prefill-size", default="1KiB", help="state size of the prefill checkpoints")
    ap.add_argument("--prefill-rounds", type=int, default=1, help="prefill in this many rounds (new writer threads each)")
    ap.add_argument("--prefill-workers", type=int, default=0, help="writer threads per prefill round (default --workers)")
    ap.add_argument("--sync", action="store_true", help="os.sync() before every sample (as run.py does)")
    ap.add_argument("--breakdown", action="store_true", help="server CPU per put by PostgreSQL process kind")
    ap.add_argument("--unix", action="store_true",
                    help="connect both savers over the cluster's Unix socket instead of TCP to 127.0.0.1")
    ap.add_argument("--wal", action="store_true", help="WAL bytes per put")
    ap.add_argument("--pg-alter", action="append", default=[],
                    help="SQL run as the owner on moorage's PostgreSQL database before measuring (repeatable)")
    ap.add_argument("--page-cache-gib", type=float, default=4.0,
                    help="memory cgroup limit around the run, as run.py (0: unbounded)")
    args = ap.parse_args()
    with PageCacheBound(int(args.page_cache_gib * (1 << 30))) as bound:
        print(f"page cache: {bound.description}", flush=True)
        _probe(args)


def _probe(args: argparse.Namespace) -> None:
    cluster = start_cluster()
    try:
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="moorage-probe-") as tmpd:
            urls: dict[str, str] = {}

            def pg_url(name: str) -> str:
                if name not in urls:
                    urls[name] = cluster.create_database(name)
                    if args.unix:
                        urls[name] = urls[name].replace("@127.0.0.1:", "@:") + f"?host={cluster.root}"
                return urls[name]

            cs = [c for c in open_contenders(stack, Path(tmpd), pg_url, args.workers) if c.backend == args.backend]
            if args.only:
                cs = [c for c in cs if c.name == args.only]
            for sql in args.pg_alter:
                cluster.psql(sql, db="moorage_bench", user="moorage_owner")
            txs = [0]
            call_s = [0.0]
            for c in cs:
                if c.name == "moorage":
                    if args.inline_max >= 0:
                        c.saver_for(0)._inline_max = args.inline_max
                        c.saver_for(0)._inline_total = 4 * args.inline_max
                    if args.log_min >= 0:
                        c.saver_for(0)._log_min = args.log_min
                    if args.inflight:
                        c.saver_for(0)._commits._max_inflight = args.inflight
                    if args.extra_min:
                        c.saver_for(0)._commits._extra_min = args.extra_min
                    be = c.saver_for(0).tenant_store.backend
                    real = be.tenant_tx

                    def counting(tenant_id, *, _real=real, **kw):
                        txs[0] += 1
                        return _real(tenant_id, **kw)

                    be.tenant_tx = counting
                    if hasattr(be, "tenant_call"):
                        real_call = be.tenant_call

                        def counting_call(tenant_id, sql, params=(), _real=real_call):
                            txs[0] += 1
                            t = time.perf_counter()
                            try:
                                return _real(tenant_id, sql, params)
                            finally:
                                call_s[0] += time.perf_counter() - t

                        be.tenant_call = counting_call
            if args.prefill:
                pw = args.prefill_workers or args.workers
                for c in cs:
                    t = time.perf_counter()
                    for r in range(args.prefill_rounds):
                        concurrent(c, f"prefill{r}-{c.name}", SIZES[args.prefill_size], "full", pw, args.prefill)
                    print(f"prefilled {c.name}: {args.prefill_rounds} x {pw} x {args.prefill} puts in "
                          f"{time.perf_counter() - t:.1f} s", flush=True)
            for rep in range(args.reps):
                for c in cs:
                    txs[0] = 0
                    call_s[0] = 0.0
                    if args.sync:
                        os.sync()
                    w0 = _wal(cluster) if args.wal else None
                    t0, b0 = os.times(), server_cpu_by()
                    rate = concurrent(c, f"p{rep}-{c.name}", SIZES[args.size], args.mode, args.workers, args.n)
                    t1, b1 = os.times(), server_cpu_by()
                    w1 = _wal(cluster) if args.wal else None
                    puts = args.workers * args.n
                    cl = (t1.user - t0.user + t1.system - t0.system) / puts * 1e3
                    sys_ = (t1.system - t0.system) / puts * 1e3
                    sv = (sum(b1.values()) - sum(b0.values())) / puts * 1e3
                    print(f"{c.backend} {c.name:13s} {args.size} {args.mode} w={args.workers}: {rate:7.0f} puts/s  "
                          f"client {cl:.3f} ms/put (sys {sys_:.3f})  server {sv:.3f} ms/put"
                          + (f"  {puts / txs[0]:.1f} puts/tx" if txs[0] else "")
                          + (f"  {call_s[0] / txs[0] * 1e3:.2f} ms/call, calls busy {call_s[0] * rate / puts:.0%} of wall"
                             if txs[0] and call_s[0] else ""), flush=True)
                    if w0 is not None and w1 is not None:
                        print(f"    WAL per put: {(w1 - w0) / puts:.0f} bytes", flush=True)
                    if args.breakdown:
                        parts = {k: (b1.get(k, 0.0) - b0.get(k, 0.0)) / puts * 1e3 for k in b1}
                        print("    server by process: " + ", ".join(
                            f"{k} {v:.3f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0), flush=True)
    finally:
        cluster.stop()


def _wal(cluster: PostgresCluster) -> int:
    """WAL bytes written so far (the insert position; pg_stat_wal's counters reach the view up to seconds late)."""
    return int(cluster.psql("SELECT pg_current_wal_insert_lsn() - '0/0'").strip().split(".")[0])


if __name__ == "__main__":
    main()
