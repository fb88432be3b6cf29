"""Lifecycle policy benchmark (simulation part): replays generated traces through every sleep policy.

Writes bench/results/latest/lifecycle_sim.{md,json}; always-on and fixed timeouts are the baselines in the
same run, the hindsight floor is the reference no online policy can reach. Last line printed: the headline.

    .venv/bin/python bench/lifecycle/run_sim.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moorage import __version__
from moorage.cost import CostModel, SimSettings, compare, generate, simulate
from moorage.lifecycle.policies import Adaptive, AlwaysOn, FixedTimeout

OUT = Path(__file__).resolve().parents[1] / "results" / "latest"
SEED = 42
SCENARIOS = ["steady", "bursty", "diurnal", "many-idle", "chatty", "periodic", "mixed"]
#: The population where no single timeout fits everyone; the headline is taken from it.
HEADLINE_SCENARIO = "mixed"


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _scenario_runs(model: CostModel, quick: bool) -> tuple[list[dict[str, Any]], list[float]]:
    runs, speeds = [], []
    for name in SCENARIOS:
        kw: dict[str, Any] = {"seed": SEED}
        if quick:
            kw["hours"] = 6
        trace = generate(name, **kw)
        t0 = time.perf_counter()
        cmp = compare(trace, model)
        elapsed = time.perf_counter() - t0
        speeds.append(len(trace.turns) * len(cmp.results) / elapsed)
        runs.append(cmp.to_dict())
        print(f"{name:<10} {len(trace.turns):>6} turns  {len(cmp.results)} policies in {elapsed:.2f} s", file=sys.stderr, flush=True)
    return runs, speeds


def _provisioning_runs(model: CostModel, quick: bool) -> list[dict[str, Any]]:
    """New agents on a many-users trace: fork on demand vs a warm pool vs cold boot (adaptive sleep policy)."""
    trace = generate("many-idle", seed=SEED, hours=6 if quick else None)
    out = []
    for label, settings in [
        ("fork on demand", SimSettings(provisioning="fork")),
        ("warm pool 8", SimSettings(provisioning="fork", warm_pool=8)),
        ("cold boot", SimSettings(provisioning="cold-boot")),
        ("cold boot + warm pool 8", SimSettings(provisioning="cold-boot", warm_pool=8)),
    ]:
        r = simulate(trace, Adaptive(model.economics()), model, settings)
        out.append(
            {
                "setting": label,
                "provisions": r.provisions,
                "provision_latency_p50_s": r.provision_p50_s,
                "provision_latency_p99_s": r.provision_p99_s,
                "pool_compute_h": r.pool_compute_s / 3600,
                "cost_total": r.cost_total,
            }
        )
    return out


def _scale_run(model: CostModel, quick: bool) -> dict[str, Any]:
    """Simulator speed on a trace of 1e5+ turns, median and range over repetitions."""
    trace = generate("steady", users=60 if quick else 250, seed=SEED)
    reps = 3
    times: dict[str, list[float]] = {}
    for policy in [AlwaysOn(), FixedTimeout(300), Adaptive(model.economics())]:
        times[policy.name] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            simulate(trace, policy, model)
            times[policy.name].append(time.perf_counter() - t0)
    return {
        "turns": len(trace.turns),
        "instances": trace.instances,
        "repetitions": reps,
        "seconds": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()},
        "turns_per_s_median": {k: len(trace.turns) / statistics.median(v) for k, v in times.items()},
    }


def _markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Lifecycle: sleep-policy simulation",
        "",
        f"moorage {doc['moorage']}, Python {doc['python']}, numpy {doc['numpy']}; seed {SEED}; "
        f"break-even idle gap {doc['break_even_s']:.1f} s. Prices and instance profile: `moorage cost prices` "
        "(defaults, docs/cost.md). Baselines in the same run: always-on and fixed idle timeouts; "
        "`hindsight` knows each next arrival and is a floor, not a policy.",
        "",
    ]
    for run in doc["scenarios"]:
        tr = run["trace"]
        lines += [
            f"## {tr['scenario']}: {tr['turns']} turns, {tr['instances']} instances, {tr['horizon_s'] / 3600:.0f} h",
            "",
            "| policy | compute-h | storage GB-h | wakes | wakes/turn | added p50 | added p99 | longest awake | cost | x always-on |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = next(r for r in run["results"] if r["policy"] == "always-on")["cost_total"]
        for r in run["results"]:
            lines.append(
                f"| {r['policy']} | {r['compute_s'] / 3600:.1f} | {r['storage_gb_h']:.2f} | {r['wakes']} | "
                f"{r['wakes_per_turn']:.2f} | {_ms(r['latency_p50_s'])} | {_ms(r['latency_p99_s'])} | "
                f"{r['longest_awake_s'] / 3600:.1f} h | {r['cost_total']:.4f} | {r['cost_total'] / base:.3f}x |"
            )
        lines += [""] + [f"- {f}" for f in run["findings"]] + [""]
    lines += [
        "## Provisioning new agents (many-idle, adaptive sleep policy)",
        "",
        "| setting | provisions | first-turn p50 | first-turn p99 | pool compute-h | cost |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in doc["provisioning"]:
        lines.append(
            f"| {p['setting']} | {p['provisions']} | {_ms(p['provision_latency_p50_s'])} | {_ms(p['provision_latency_p99_s'])} "
            f"| {p['pool_compute_h']:.1f} | {p['cost_total']:.4f} |"
        )
    s = doc["scale"]
    lines += ["", f"## Simulator speed: {s['turns']} turns, {s['instances']} instances, {s['repetitions']} repetitions", ""]
    lines += ["| policy | median s | min–max s | turns/s |", "|---|---:|---:|---:|"]
    for k, v in s["seconds"].items():
        lines.append(f"| {k} | {v['median']:.2f} | {v['min']:.2f}–{v['max']:.2f} | {s['turns_per_s_median'][k]:,.0f} |")
    lines += ["", doc["headline"], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="6-hour traces and a smaller scale run")
    args = ap.parse_args()
    model = CostModel()
    scenarios, speeds = _scenario_runs(model, args.quick)
    doc: dict[str, Any] = {
        "moorage": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "seed": SEED,
        "break_even_s": model.economics().break_even_s,
        "prices": model.to_toml(),
        "scenarios": scenarios,
        "provisioning": _provisioning_runs(model, args.quick),
        "scale": _scale_run(model, args.quick),
        "replay_turns_per_s": {"median": statistics.median(speeds), "min": min(speeds), "max": max(speeds)},
    }
    head = next(s for s in scenarios if s["trace"]["scenario"] == HEADLINE_SCENARIO)
    res = {r["policy"]: r for r in head["results"]}
    a = res["adaptive"]
    fixed = [r for r in head["results"] if r["policy"].startswith("fixed-")]
    best = min(fixed, key=lambda r: r["cost_total"])
    wins = sum(
        1
        for s in scenarios
        if next(r for r in s["results"] if r["policy"] == "adaptive")["cost_total"]
        < min(r["cost_total"] for r in s["results"] if r["policy"].startswith("fixed-"))
    )
    doc["adaptive_beats_every_fixed_in"] = f"{wins}/{len(scenarios)} scenarios"
    doc["headline"] = (
        f"adaptive ({HEADLINE_SCENARIO}): cost {a['cost_total'] / res['fixed-5min']['cost_total']:.2f}x fixed-5min, "
        f"{a['cost_total'] / best['cost_total']:.2f}x best fixed ({best['policy']}), "
        f"{a['cost_total'] / res['always-on']['cost_total']:.2f}x always-on; added latency p99 {_ms(a['latency_p99_s'])}; "
        f"beats every fixed timeout in {wins}/{len(scenarios)} scenarios"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "lifecycle_sim.json").write_text(json.dumps(doc, indent=2) + "\n")
    (OUT / "lifecycle_sim.md").write_text(_markdown(doc))
    print(f"wrote {OUT / 'lifecycle_sim.md'} and .json", file=sys.stderr, flush=True)
    print(doc["headline"])


if __name__ == "__main__":
    main()
