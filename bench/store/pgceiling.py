"""PostgreSQL: what any client reaches on this host, measured beside the throughput cells as their ceiling.

The savers and the server share this host's cores, so a cell's rate is bounded by the host as well as by the
saver. To tell the two apart, pgbench (PostgreSQL's own C client: prepared statements, no Python, no
LangGraph) writes durable rows to the same cluster, with the same settings, in the same run: ``w`` puts in
flight as ``c`` connections each committing ``k`` rows per transaction (``c * k = w``: ``k = 1`` is how the
peer commits, one transaction per put; larger ``k`` is group commit's batching), one 1 KiB row per put,
each connection waiting for its commit before it sends the next (a closed loop, as the savers' writer threads).

Beside them, the floor of the peer's pattern in Python: one thread per writer, each on its own connection,
committing one prepared 1 KiB row per put through libpq directly (psycopg's ``PGconn.exec_prepared``, which
waits without the GIL), nothing else per put: no LangGraph, no serialisation.

Two pgbench targets: a plain table (a primary key and an upsert, no row-level security) and moorage's own write path
(``moorage_lg_write`` called as the application role with forced row-level security, in a database and tenant
of its own). Each put of a LangGraph saver writes at least such a row (``PostgresSaver`` also writes each
channel value as a row of its own) and does its Python work on the same cores, so the best grouping's rate is
an upper bound for any saver with ``w`` writers on this host. The row's values are made by the server
(``repeat``) rather than sent, which costs it about what receiving them would.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import psycopg
from psycopg import pq

from report import section, table_head

#: Rows per transaction tried at each level (``w // k`` connections each); the best is the ceiling.
GROUPINGS = (1, 2, 4, 8)
#: Seconds per pgbench sample.
SECONDS = 4
#: The row each put writes.
ROW_BYTES = 1024

_TARGETS = {"plain": "plain table", "moorage": "moorage's write path",
            "python": "peer's pattern in Python (raw libpq calls, thread per writer)"}
_TPS = re.compile(r"^tps = ([\d.]+)", re.MULTILINE)


def _plain_sql(k: int) -> str:
    return ("\\set key random(1, 1000000000000)\n"
            "INSERT INTO ceiling_rows (thread_id, checkpoint_ns, checkpoint_id, type, checkpoint, metadata) "
            f"SELECT :client_id::text, '', :key::text || '-' || g, 'msgpack', convert_to(repeat('x', {ROW_BYTES}), 'UTF8'), "
            f"'{{}}' FROM generate_series(1, {k}) AS g "
            "ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET checkpoint = excluded.checkpoint;\n")


def _moorage_sql(k: int, tenant_id: str) -> str:
    n = f"ARRAY[{k}]"
    return ("\\set key random(1, 1000000000000)\n"
            f"SELECT moorage_lg_write('{tenant_id}', c_thread => array_fill(:client_id::text, {n}), "
            f"c_ns => array_fill(''::text, {n}), "
            f"c_id => ARRAY(SELECT :key::text || '-' || g FROM generate_series(1, {k}) AS g), "
            f"c_parent => array_fill(NULL::text, {n}), c_run => array_fill(NULL::text, {n}), "
            f"c_type => array_fill('msgpack'::text, {n}), "
            f"c_blob => array_fill(convert_to(repeat('x', {ROW_BYTES}), 'UTF8'), {n}), "
            f"c_meta => array_fill('{{}}'::text, {n}), c_versions => array_fill('{{}}'::text, {n}));\n")


def pg_ceiling(cluster: Any, create_db: Callable[[str], str], open_tenant: Callable[[str], str],
               levels: Sequence[int], rounds: int, seconds: int = SECONDS) -> list[dict[str, Any]]:
    """pgbench's committed rows/s at each level of ``levels`` (puts in flight) for every grouping of
    ``GROUPINGS`` that fits, on both targets, and ``python_floor``'s at each level; ``rounds`` samples each
    (in alternating order), every sample from an emptied table after a checkpoint. ``create_db(name)`` makes a database owned
    by the owner role; ``open_tenant(name)`` migrates a database for moorage and returns a new tenant's id."""
    create_db("ceiling_plain")
    cluster.psql("CREATE TABLE ceiling_rows (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL, "
                 "checkpoint_id TEXT NOT NULL, type TEXT NOT NULL, checkpoint BYTEA NOT NULL, metadata TEXT NOT NULL, "
                 "PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))", db="ceiling_plain", user="moorage_owner")
    tenant_id = open_tenant("ceiling_moorage")
    targets = {
        "plain": ("ceiling_plain", "moorage_owner", "ceiling_rows", _plain_sql),
        "moorage": ("ceiling_moorage", "moorage_app", "lg_checkpoints", lambda k: _moorage_sql(k, tenant_id)),
    }
    configs = [(t, w, k) for w in levels for k in GROUPINGS if k <= w and w % k == 0 for t in targets]
    configs += [("python", w, 1) for w in levels]
    samples: dict[tuple[str, int, int], list[float]] = {cfg: [] for cfg in configs}
    with tempfile.TemporaryDirectory(prefix="moorage-pgbench-") as d:
        for rnd in range(rounds):
            for target, w, k in (configs if rnd % 2 == 0 else configs[::-1]):
                db, user, table, sql = targets["plain" if target == "python" else target]
                cluster.psql(f"TRUNCATE {table}", db=db, user="moorage_owner")
                cluster.psql("CHECKPOINT")
                if target == "python":
                    samples[(target, w, k)].append(python_floor(cluster.url_for(db), w, seconds))
                    continue
                script = Path(d) / f"{target}-{k}.sql"
                script.write_text(sql(k))
                clients = w // k
                r = subprocess.run([str(cluster.bindir / "pgbench"), "-n", "-M", "prepared", "-c", str(clients),
                                    "-j", str(min(clients, 4)), "-T", str(seconds), "-f", str(script),
                                    "-h", "127.0.0.1", "-p", str(cluster.port), "-U", user, db],
                                   capture_output=True, text=True, timeout=seconds + 120)
                m = _TPS.search(r.stdout)
                if r.returncode != 0 or m is None:
                    raise RuntimeError(f"pgbench failed ({target}, {clients} x {k}): {r.stderr.strip()[-500:]}")
                samples[(target, w, k)].append(float(m.group(1)) * k)
    for db, _, table, _ in targets.values():  # what follows starts from a small, checkpointed cluster
        cluster.psql(f"TRUNCATE {table}", db=db, user="moorage_owner")
    cluster.psql("CHECKPOINT")
    out = []
    for (target, w, k), xs in samples.items():
        out.append({"target": target, "writers": w, "clients": w // k, "rows_per_tx": k, "samples": xs,
                    "best": max(xs), "row_bytes": ROW_BYTES, "seconds": seconds})
        print(f"pg ceiling {target:8s} {w:2d} in flight as {w // k:2d} x {k} rows/tx: best {max(xs):.0f} rows/s "
              f"({', '.join(f'{x:.0f}' for x in xs)})", flush=True)
    return out


def python_floor(url: str, writers: int, seconds: float) -> float:
    """Rows/s of ``writers`` Python threads, each committing one prepared 1 KiB row per transaction into
    ``ceiling_rows`` on its own autocommit connection, for ``seconds``."""
    sql = (b"INSERT INTO ceiling_rows (thread_id, checkpoint_ns, checkpoint_id, type, checkpoint, metadata) "
           b"VALUES ($1, '', $2, 'msgpack', $3, '{}') "
           b"ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET checkpoint = excluded.checkpoint")
    conns = [psycopg.connect(url, autocommit=True) for _ in range(writers)]
    counts = [0] * writers
    start = threading.Barrier(writers + 1)
    stop = threading.Event()
    errors: list[str] = []

    def run(i: int) -> None:
        pg = conns[i].pgconn
        res = pg.prepare(b"floor", sql)
        blob = os.urandom(ROW_BYTES)
        start.wait()  # every thread reaches it, so a failed one cannot leave the others waiting
        if res.status != pq.ExecStatus.COMMAND_OK:
            errors.append(res.error_message.decode(errors="replace"))
            return
        n = 0
        while not stop.is_set():
            res = pg.exec_prepared(b"floor", [str(i).encode(), b"%d-%d" % (i, n), blob], [0, 0, 1])
            if res.status != pq.ExecStatus.COMMAND_OK:
                errors.append(res.error_message.decode(errors="replace"))
                return
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    if errors:
        raise RuntimeError(f"python floor failed: {errors[0]}")
    return sum(counts) / elapsed


def best_by_level(rows: list[dict[str, Any]], target: str) -> dict[int, dict[str, Any]]:
    """The best grouping per level for ``target``."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["target"] == target and (r["writers"] not in out or r["best"] > out[r["writers"]]["best"]):
            out[r["writers"]] = r
    return out


def _peer_and_moorage(checkpoints: list[dict[str, Any]], w: int) -> tuple[float, float] | None:
    """PostgreSQL 1 KiB ``full`` medians at ``w`` writers from the cells: (peer, moorage), if measured."""
    def rate(saver: str) -> float | None:
        for r in checkpoints:
            if (r["backend"], r["size"], r["mode"], r["saver"]) == ("postgres", "1KiB", "full", saver):
                return r["concurrent"].get(str(w))
        return None
    p, m = rate("PostgresSaver"), rate("moorage")
    return (p, m) if p and m else None


def ceiling_lines(rows: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    levels = sorted({r["writers"] for r in rows})
    ks = [k for k in GROUPINGS if any(r["rows_per_tx"] == k for r in rows)]
    lines = section("PostgreSQL: what any client reaches on this host (pgbench, a ceiling for the cells)",
                    "PostgreSQL's C client writes one durable 1 KiB row per put on the same cluster in the same run: "
                    "`w` puts in flight as `w/k` connections committing `k` rows per transaction, closed loop (see "
                    "bench/store/pgceiling.py). Rows/s, best of the samples, for a plain table and for moorage's own "
                    "write path (its write function as the application role, forced row-level security). The best "
                    "grouping bounds any saver with `w` writers on this host: every put writes at least that row, and a "
                    "saver's Python shares the cores. Last row per level: one Python thread per writer, each on its own "
                    "connection committing one prepared row per put through libpq, nothing else (the floor of the "
                    "peer's pattern in Python).",
                    ["in flight", "target"] + [f"{k} row{'s' if k > 1 else ''}/tx" for k in ks])
    for w in levels:
        for target in ("plain", "moorage", "python"):
            cells = []
            for k in ks:
                r = next((r for r in rows if (r["target"], r["writers"], r["rows_per_tx"]) == (target, w, k)), None)
                cells.append(f"{r['best']:.0f}" if r else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {w} | {_TARGETS[target]} | " + " | ".join(cells) + " |")
    lines += ["", "Against the cells (PostgreSQL 1 KiB `full`, medians):", "",
              *table_head(["writers", "peer puts/s", "2x the peer", "ceiling, plain (best grouping)",
                           "ceiling, moorage's path", "2x the peer / ceiling (moorage's path)", "moorage puts/s",
                           "moorage / ceiling (moorage's path)", "peer's pattern in Python"])]
    plain, mine, py = best_by_level(rows, "plain"), best_by_level(rows, "moorage"), best_by_level(rows, "python")
    for w in levels:
        pm = _peer_and_moorage(checkpoints, w)
        if pm is None or w not in plain or w not in mine:
            continue
        p, m = pm
        a, b = plain[w], mine[w]
        lines.append(f"| {w} | {p:.0f} | {2 * p:.0f} | {a['best']:.0f} ({a['clients']} x {a['rows_per_tx']}) | "
                     f"{b['best']:.0f} ({b['clients']} x {b['rows_per_tx']}) | {2 * p / b['best']:.0%} | {m:.0f} | "
                     f"{m / b['best']:.0%} | " + (f"{py[w]['best']:.0f} |" if w in py else "- |"))
    return lines


def ceiling_headline(rows: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    plain, mine, py = best_by_level(rows, "plain"), best_by_level(rows, "moorage"), best_by_level(rows, "python")
    parts = []
    for w in sorted(mine):
        pm = _peer_and_moorage(checkpoints, w)
        extra = f" against 2x the peer's median {2 * pm[0]:.0f}" if pm else ""
        floor = f"; the peer's pattern in bare Python {py[w]['best']:.0f}" if w in py else ""
        parts.append(f"{w} in flight: plain {plain[w]['best']:.0f}, moorage's path {mine[w]['best']:.0f}{extra}{floor}")
    return ("PostgreSQL ceiling (pgbench, C client, one 1 KiB row per put, best grouping, puts/s): "
            + " | ".join(parts))
