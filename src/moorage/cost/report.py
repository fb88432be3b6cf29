"""Policy comparison on one trace: runs every policy, derives the findings, renders a rich table or JSON.

Used by ``moorage cost simulate`` and bench/lifecycle/run_sim.py, so both report the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from moorage.cost.model import CostModel
from moorage.cost.simulator import Hindsight, PolicyResult, SimSettings, simulate
from moorage.cost.trace import Trace
from moorage.errors import InvalidInput
from moorage.lifecycle.policies import Adaptive, AlwaysOn, FixedTimeout, SleepPolicy

#: Fixed idle timeouts compared by default: from "too early" to "never fires" for common habits.
DEFAULT_TIMEOUTS_S = (10.0, 30.0, 60.0, 300.0, 900.0)


def default_policies(model: CostModel) -> list[SleepPolicy]:
    return [AlwaysOn(), *(FixedTimeout(t) for t in DEFAULT_TIMEOUTS_S), Adaptive(model.economics())]


@dataclass(frozen=True)
class Comparison:
    trace_meta: dict[str, Any]
    turns: int
    instances: int
    horizon_s: float
    break_even_s: float
    settings: SimSettings
    results: list[PolicyResult]
    findings: list[str] = field(default_factory=list)

    def result(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise InvalidInput(f"no result for policy {policy!r}", hint=f"replayed: {', '.join(r.policy for r in self.results)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace": {**self.trace_meta, "turns": self.turns, "instances": self.instances, "horizon_s": self.horizon_s},
            "break_even_s": self.break_even_s,
            "settings": {"provisioning": self.settings.provisioning, "warm_pool": self.settings.warm_pool},
            "results": [r.to_dict() for r in self.results],
            "findings": self.findings,
        }


def compare(
    trace: Trace,
    model: CostModel | None = None,
    policies: Sequence[SleepPolicy] | None = None,
    settings: SimSettings | None = None,
    *,
    hindsight: bool = True,
) -> Comparison:
    """Replay ``trace`` through each policy (default: always-on, fixed timeouts, adaptive) and the hindsight floor."""
    model = model or CostModel()
    settings = settings or SimSettings()
    chosen = list(policies) if policies is not None else default_policies(model)
    names = [p.name for p in chosen]
    if len(set(names)) != len(names):
        raise InvalidInput(f"policies must have distinct names, got {names}")
    if hindsight:
        chosen.append(Hindsight(trace, model))
    results = [simulate(trace, p, model, settings) for p in chosen]
    return Comparison(
        trace_meta=dict(trace.meta),
        turns=len(trace.turns),
        instances=trace.instances,
        horizon_s=trace.horizon_s,
        break_even_s=model.economics().break_even_s,
        settings=settings,
        results=results,
        findings=_findings(results, trace.horizon_s),
    )


def _hours(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 360 else f"{s:.0f} s"


def _findings(results: list[PolicyResult], horizon_s: float) -> list[str]:
    """Plain sentences on what the numbers show: the two fixed-timeout failure modes and where adaptive stands."""
    out: list[str] = []
    by = {r.policy: r for r in results}
    adaptive = by.get("adaptive")
    fixed = [r for r in results if r.policy.startswith("fixed-")]
    for r in fixed:
        # "Never fires": turns come more often than the timeout, so one instance stays up for most of the replay.
        if r.longest_awake_s >= 0.25 * horizon_s and (adaptive is None or r.cost_total > adaptive.cost_total):
            ref = f"; adaptive's longest stretch is {_hours(adaptive.longest_awake_s)}" if adaptive else ""
            out.append(
                f"{r.policy} never fired for some instance: kept it awake {_hours(r.longest_awake_s)} straight "
                f"({r.compute_s / 3600:.1f} awake-h in all{ref})."
            )
    for r in fixed:
        # "Fires too early": most turns pay a wake and the instance still idled for the whole timeout first.
        if r.wakes_per_turn >= 0.3 and adaptive is not None and r.cost_total > adaptive.cost_total:
            out.append(
                f"{r.policy} fires too early: {r.wakes_per_turn:.2f} wakes per turn, and each still idled "
                f"{r.policy.removeprefix('fixed-')} first — {r.cost_total / adaptive.cost_total:.2f}x adaptive's cost."
            )
    if adaptive is not None and fixed:
        best = min(fixed, key=lambda r: r.cost_total)
        ratio = adaptive.cost_total / best.cost_total if best.cost_total else float("inf")
        if ratio < 0.995:
            out.append(f"adaptive beats every fixed timeout: {ratio:.2f}x the cost of the best one ({best.policy}).")
        elif ratio <= 1.005:
            out.append(f"adaptive matches the best fixed timeout ({best.policy}) within 0.5%: no timeout does better here.")
        else:
            out.append(
                f"adaptive does NOT beat every fixed timeout here: {ratio:.2f}x the cost of {best.policy}, "
                "a timeout picked in hindsight for this trace."
            )
        hs = by.get("hindsight")
        if hs is not None and hs.cost_total > 0:
            out.append(f"adaptive is {adaptive.cost_total / hs.cost_total:.2f}x the hindsight floor (not deployable: it knows the future).")
    return out


def _money(v: float) -> str:
    return f"{v:.4f}" if v < 100 else f"{v:,.2f}"


def render(cmp: Comparison, console: Console) -> None:
    meta = ", ".join(f"{k}={v}" for k, v in cmp.trace_meta.items())
    title = f"{cmp.turns} turns, {cmp.instances} instances, {cmp.horizon_s / 3600:.1f} h" + (f" ({meta})" if meta else "")
    cur = cmp.results[0].currency if cmp.results else ""
    t = Table(
        title=title,
        caption=f"break-even idle gap {cmp.break_even_s:.1f} s; cost in {cur} = compute + snapshot storage + wait; "
        "hindsight is a floor, not a policy",
    )
    base = next((r for r in cmp.results if r.policy == "always-on"), None)
    new_users = any(r.provisions for r in cmp.results)  # what a new user's first turn waits (warm pool, fork, boot)
    cols = ["policy", "awake h", "snap GB-h", "wakes", "/turn", "p50", "p99", *(["1st turn p99"] if new_users else []),
            "longest up", "cost"]
    for col in cols + (["x always-on"] if base else []):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    cheapest = min((r.cost_total for r in cmp.results if r.policy != "hindsight"), default=0.0)
    for r in cmp.results:
        total = _money(r.cost_total)
        if r.cost_total == cheapest and r.policy != "hindsight":
            total = f"[bold green]{total}[/]"
        row = [
            f"[dim]{r.policy}[/]" if r.policy == "hindsight" else r.policy,
            f"{(r.compute_s + r.pool_compute_s) / 3600:.1f}",
            f"{r.storage_gb_h:.2f}",
            str(r.wakes),
            f"{r.wakes_per_turn:.2f}",
            f"{r.latency_p50_s * 1000:.0f} ms",
            f"{r.latency_p99_s * 1000:.0f} ms",
            *([f"{r.provision_p99_s * 1000:.0f} ms"] if new_users else []),
            _hours(r.longest_awake_s),
            total,
        ]
        if base:
            row.append(f"{r.cost_total / base.cost_total:.2f}x" if base.cost_total else "-")
        t.add_row(*row)
    console.print(t)
    for line in cmp.findings:
        console.print(f"• {line}", highlight=False)
