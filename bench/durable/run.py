"""Durable-step overhead: moorage's engine on its SQLite store vs DBOS steps on its SQLite system database.

Run: ``.venv/bin/python bench/durable/run.py [--quick]``; writes bench/results/latest/durable.{md,json}.
Each step body is trivial, so the time around ``await ctx.step(...)`` / a DBOS step call is the durability cost.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moorage.durable import DurableEngine, WorkflowContext
from moorage.store import Scope, Store
from moorage.store.sqlite import SQLiteBackend

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"
PEER = Path(__file__).with_name("peer_dbos.py")


def moorage_run(workdir: Path, workflows: int, steps: int) -> dict[str, Any]:
    store = Store(SQLiteBackend(workdir / "store"))
    _, key = store.operator.create_tenant("bench")
    ts = store.tenant(store.authenticate(key.secret))
    lat: list[float] = []

    def body(i: int) -> int:
        return i

    async def wf(ctx: WorkflowContext, n: int) -> int:
        total = 0
        for i in range(n):
            t = time.perf_counter()
            total += await ctx.step("s", body, i)
            lat.append(time.perf_counter() - t)
        return total

    async def go() -> float:
        engine = DurableEngine(ts, {"wf": wf})
        t0 = time.perf_counter()
        for w in range(workflows):
            run = await engine.start(Scope.workflow("bench", f"run-{w}", "u"), "wf", wf, steps)
            assert run.status == "succeeded" and run.result == steps * (steps - 1) // 2
        return time.perf_counter() - t0

    wall = asyncio.run(go())
    with store.backend.tenant_tx(ts.tenant_id, write=False) as c:  # the very connection the engine wrote with
        mode, sync = c.one("PRAGMA journal_mode")[0], c.one("PRAGMA synchronous")[0]
    store.close()
    return {"lat": lat, "wall": wall, "journal_mode": mode, "synchronous": sync}


def dbos_run(workdir: Path, workflows: int, steps: int, mode: str, journal: str) -> dict[str, Any]:
    db = workdir / f"dbos-{mode}-{journal}.sqlite"
    out = subprocess.run([sys.executable, str(PEER), str(db), str(workflows), str(steps), mode, journal],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(name: str, settings: str, r: dict[str, Any]) -> dict[str, Any]:
    lat = sorted(x * 1000 for x in r["lat"])
    return {
        "name": name, "settings": settings, "steps": len(lat),
        "p50_ms": statistics.median(lat), "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "min_ms": lat[0], "max_ms": lat[-1], "steps_per_s": len(lat) / r["wall"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer workflows (a smoke run)")
    ap.add_argument("--workflows", type=int, default=30)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    workflows = 5 if args.quick else args.workflows
    steps = args.steps
    version = importlib.metadata.version("dbos")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Interleave two rounds of each contender so that machine noise hits all of them alike.
        results: dict[str, list[dict[str, Any]]] = {}
        settings: dict[str, str] = {}
        for rnd in range(2):
            m = moorage_run(work / f"m{rnd}", workflows, steps)
            results.setdefault("moorage", []).append(m)
            settings["moorage"] = f"SQLite journal_mode={m['journal_mode']} synchronous={m['synchronous']} (FULL)"
            for mode in ("sync", "async"):
                for journal in ("default", "wal"):
                    (work / f"d{rnd}").mkdir(exist_ok=True)
                    d = dbos_run(work / f"d{rnd}", workflows, steps, mode, journal)
                    name = f"dbos {mode} {'WAL' if journal == 'wal' else 'as shipped'}"
                    results.setdefault(name, []).append(d)
                    settings[name] = f"SQLite journal_mode={d['journal_mode']} synchronous={d['synchronous']} (FULL)"
        for name, rs in results.items():
            merged = {"lat": [x for r in rs for x in r["lat"]], "wall": sum(r["wall"] for r in rs)}
            rows.append(summary(name, settings[name], merged))

    ours = rows[0]
    peers = rows[1:]
    best_peer = min(peers, key=lambda r: r["p50_ms"])
    same = next(r for r in peers if r["name"] == "dbos async WAL")
    for r in rows:
        r["ratio_p50_vs_moorage"] = r["p50_ms"] / ours["p50_ms"]
    report = {
        "bench": "durable", "dbos_version": version, "python": platform.python_version(),
        "workflows": workflows * 2, "steps_per_workflow": steps, "contenders": rows,
        "notes": "per-step latency around the step call inside a workflow; trivial body; every step result is "
                 "committed to disk (synchronous=FULL) before the call returns, for all contenders",
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "durable.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# durable: step overhead, moorage vs DBOS", "",
        f"DBOS {version}, Python {platform.python_version()}; {workflows * 2} workflows x {steps} steps per contender "
        "(two interleaved rounds), trivial step body; both on SQLite with every commit fsynced (synchronous=FULL).", "",
        "| contender | settings | steps | p50 ms | p99 ms | min-max ms | steps/s | p50 / moorage p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['settings']} | {r['steps']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                     f"{r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['steps_per_s']:.0f} | {r['ratio_p50_vs_moorage']:.2f}x |")
    headline = (f"durable step p50 {ours['p50_ms']:.2f} ms p99 {ours['p99_ms']:.2f} ms {ours['steps_per_s']:.0f} steps/s; "
                f"DBOS {version} same settings (async, WAL) p50 {same['p50_ms']:.2f} ms ({same['p50_ms'] / ours['p50_ms']:.2f}x), "
                f"best DBOS ({best_peer['name']}) p50 {best_peer['p50_ms']:.2f} ms ({best_peer['p50_ms'] / ours['p50_ms']:.2f}x)")
    lines += ["", headline, ""]
    (OUT / "durable.md").write_text("\n".join(lines))
    print("\n".join(lines[4:-2]))
    print(headline)


if __name__ == "__main__":
    main()
