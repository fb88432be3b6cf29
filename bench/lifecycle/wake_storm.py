"""Lifecycle benchmark (live part): a wake storm on one sleeping agent, and the latency the router adds per turn.

Real sandboxes (the configured driver), a real SQLite store in a temporary directory. Baseline in the same run: the
same turn sent straight to the awake sandbox's channel. Writes bench/results/latest/lifecycle_wake.{md,json};
the last line printed is the headline.

    .venv/bin/python bench/lifecycle/wake_storm.py [--driver process] [--rounds 5] [--turns 200] [--storm 100] [--wakes 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moorage import __version__
from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.lifecycle.policies import FixedTimeout
from moorage.router import Router
from moorage.sandbox import Sandbox, TemplateRef, get_driver
from moorage.store import EntityKey, Scope, Store
from moorage.store.sqlite import SQLiteBackend

OUT = Path(__file__).resolve().parents[1] / "results" / "latest"


async def forward(sandbox: Sandbox, turn: str) -> str:
    """The turn: one exec round trip through the guest channel (what every real turn pays at least once)."""
    r = await sandbox.exec(["echo", turn])
    return r.stdout_text.strip()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1e3, "p99_ms": _pct(xs, 0.99) * 1e3,
            "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3}


async def run(driver_name: str, rounds: int, turns: int, storm: int, wake_rounds: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="moorage-bench-"))
    cfg = Config(data_dir=tmp / "data", sandbox_driver=driver_name)
    store = Store(SQLiteBackend(tmp / "store"))
    _, key = store.operator.create_tenant("bench")
    principal = store.authenticate(key.secret)
    ts = store.tenant(principal)
    ts.agents.create("bench", {"lifecycle": {"users": "auto", "concurrency": "parallel"}})
    driver = get_driver(cfg, tmp / "sandboxes")
    src = await driver.create("template-src")
    await src.start()
    template = await driver.make_template(src, "tpl-bench")
    await src.destroy()

    async def templates(_ts: Any, _agent: Any) -> TemplateRef:
        return template

    manager = InstanceManager(store, driver, host_id="bench", policy=FixedTimeout(3600))
    await manager.start(background=False)
    router = Router(store, manager, forward, templates, max_pending=10 * storm)
    scope = Scope.for_user("bench", "u")
    key = EntityKey("bench", "u")
    try:
        await router.route(principal, key, "warm")
        sandbox = await manager.ensure_running(ts, scope, template)
        direct, awake, asleep, wake_counts, storm_ok = [], [], [], [], []
        for i in range(turns):  # baseline and router, interleaved so noise hits both alike
            t = time.perf_counter()
            assert await forward(sandbox, f"d{i}") == f"d{i}"
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert await router.route(principal, key, f"a{i}") == f"a{i}"
            awake.append(time.perf_counter() - t)
        for r in range(wake_rounds):
            assert await manager.sleep(ts, scope)
            t = time.perf_counter()
            assert await router.route(principal, key, f"s{r}") == f"s{r}"
            asleep.append(time.perf_counter() - t)
        for r in range(rounds):
            assert await manager.sleep(ts, scope)
            before = ts.usage.totals().get("wakes", 0)
            replies = await asyncio.gather(*[router.route(principal, EntityKey("bench", "u", session=f"r{r}s{i}"), f"{r}-{i}")
                                             for i in range(storm)])
            storm_ok.append(replies == [f"{r}-{i}" for i in range(storm)])
            wake_counts.append(int(ts.usage.totals()["wakes"] - before))
    finally:
        await manager.close()
        for sid in await driver.list():
            await (await driver.open(sid)).destroy()
        await driver.close()
        store.close()
    d, a, s = _summary(direct), _summary(awake), _summary(asleep)
    added_awake = [x - y for x, y in zip(awake, direct)]
    added_asleep = [x - statistics.median(direct) for x in asleep]
    return {
        "moorage": __version__, "python": platform.python_version(), "driver": driver_name, "store": "sqlite",
        "storm": {"concurrent": storm, "rounds": rounds, "wakes_per_round": wake_counts, "all_replies_correct": all(storm_ok)},
        "turn_direct": d, "turn_awake": a, "turn_sleeping": s,
        # Added latency per turn: each routed turn minus its interleaved direct twin (awake), or minus the direct
        # median (sleeping), so the percentiles are of the differences, not differences of percentiles.
        "added_awake_p50_ms": statistics.median(added_awake) * 1e3, "added_awake_p99_ms": _pct(added_awake, 0.99) * 1e3,
        "added_sleeping_p50_ms": statistics.median(added_asleep) * 1e3,
        "added_sleeping_p99_ms": _pct(added_asleep, 0.99) * 1e3,
    }


def report(res: dict[str, Any]) -> str:
    rows = [("direct channel call (baseline)", res["turn_direct"]), ("router, awake instance", res["turn_awake"]),
            ("router, sleeping instance (wake + turn)", res["turn_sleeping"])]
    st = res["storm"]
    lines = [
        "# Lifecycle: wake storm and per-turn router latency", "",
        f"moorage {res['moorage']}, Python {res['python']}, driver `{res['driver']}`, store {res['store']}. "
        "Turn = one `echo` exec over the guest channel. Baseline in the same run: the same turn sent straight to the "
        "awake sandbox, interleaved with the routed turns.", "",
        f"## Wake storm: {st['concurrent']} concurrent requests to one sleeping agent, {st['rounds']} rounds", "",
        f"wakes per round: {st['wakes_per_round']} (must be 1 each); every reply correct: {st['all_replies_correct']}", "",
        "## Turn latency", "", "| path | n | p50 | p99 | min | max |", "|---|---:|---:|---:|---:|---:|",
    ]
    for name, x in rows:
        lines.append(f"| {name} | {x['n']} | {x['p50_ms']:.1f} ms | {x['p99_ms']:.1f} ms | {x['min_ms']:.1f} ms | {x['max_ms']:.1f} ms |")
    lines += ["", f"Added by the router over the direct call: awake p50 {res['added_awake_p50_ms']:.1f} ms, "
              f"p99 {res['added_awake_p99_ms']:.1f} ms; sleeping p50 {res['added_sleeping_p50_ms']:.1f} ms, "
              f"p99 {res['added_sleeping_p99_ms']:.1f} ms."]
    return "\n".join(lines) + "\n"


def headline(res: dict[str, Any]) -> str:
    st = res["storm"]
    w = st["wakes_per_round"]
    ratio = res["turn_sleeping"]["p50_ms"] / res["turn_awake"]["p50_ms"]
    return (f"wake storm {st['concurrent']} concurrent -> wakes {max(w)} max over {len(w)} rounds (must be 1); "
            f"router adds p50 {res['added_awake_p50_ms']:.1f} ms p99 {res['added_awake_p99_ms']:.1f} ms awake, "
            f"p50 {res['added_sleeping_p50_ms']:.0f} ms p99 {res['added_sleeping_p99_ms']:.0f} ms asleep; "
            f"sleeping/awake turn {ratio:.0f}x ({res['driver']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", default="process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--storm", type=int, default=100)
    ap.add_argument("--wakes", type=int, default=30, help="single-turn wakes timed")
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer turns (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.turns, args.wakes = 2, 50, 8
    res = asyncio.run(run(args.driver, args.rounds, args.turns, args.storm, args.wakes))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "lifecycle_wake.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "lifecycle_wake.md").write_text(report(res))
    print(report(res))
    print(headline(res))
    return 0 if all(w == 1 for w in res["storm"]["wakes_per_round"]) and res["storm"]["all_replies_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
