"""``moorage cost``: replay arrival traces through sleep policies, generate traces, print the price table.

Thin layer: parses options, calls moorage.cost, renders; errors are moorage's typed errors.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import typer

from moorage.cli.console import make_console

# moorage.cost is imported by each command, not here: it brings numpy, which every other command would pay for.

app = typer.Typer(no_args_is_help=True, help="Cost model and sleep-policy simulator.")
trace_app = typer.Typer(no_args_is_help=True, help="Arrival traces (JSONL, one turn per line).")
app.add_typer(trace_app, name="trace")


@app.command()
def simulate(
    trace: Path = typer.Option(..., "--trace", help="Trace file (JSONL); see docs/cost.md."),
    prices: Optional[Path] = typer.Option(None, "--prices", help="TOML with \\[prices] and \\[instance] tables (defaults: `moorage cost prices`)."),
    policy: Optional[List[str]] = typer.Option(
        None, "--policy", help="Policy to replay, repeatable: always-on, adaptive, fixed:300, fixed-30s (default: a standard set)."
    ),
    provisioning: str = typer.Option("fork", "--provisioning", help="How new agents start without a pool: fork or cold-boot."),
    warm_pool: int = typer.Option(0, "--warm-pool", help="Pre-forked sandboxes kept running for new agents."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Replay a trace through each policy and report compute, storage, wakes, added latency and cost."""
    from moorage.cost import SimSettings, compare, load_cost_model, read_trace, render
    from moorage.lifecycle.policies import parse_policy

    model = load_cost_model(prices)
    policies = [parse_policy(p, model.economics()) for p in policy] if policy else None
    cmp = compare(read_trace(trace), model, policies, SimSettings(provisioning=provisioning, warm_pool=warm_pool))  # type: ignore[arg-type]
    if as_json:
        typer.echo(json.dumps(cmp.to_dict(), indent=2))
    else:
        render(cmp, make_console())


@trace_app.command("generate")
def trace_generate(
    scenario: str = typer.Option(..., "--scenario", help="A name `moorage cost trace scenarios` lists."),
    out: Path = typer.Option(..., "--out", help="File to write (JSONL)."),
    users: Optional[int] = typer.Option(None, "--users", help="Number of users (default depends on the scenario)."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Trace length in hours (default depends on the scenario)."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same trace."),
) -> None:
    """Generate a synthetic arrival trace for a named scenario."""
    from moorage.cost import generate, save_trace

    trace = generate(scenario, users=users, hours=hours, seed=seed)
    save_trace(trace, out)
    typer.echo(f"wrote {len(trace.turns)} turns for {trace.instances} instances over {trace.horizon_s / 3600:g} h to {out}")


@trace_app.command("scenarios")
def trace_scenarios(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List the named scenarios."""
    from moorage.cost import SCENARIOS

    if as_json:
        typer.echo(json.dumps({"data": [{"name": s.name, "users": s.default_users, "hours": s.default_hours,
                                         "description": s.description} for s in SCENARIOS.values()]}, indent=2))
        return
    for s in SCENARIOS.values():
        typer.echo(f"{s.name:<10} {s.default_users:>5} users {s.default_hours:>4g} h  {s.description}")


@app.command()
def prices(prices_file: Optional[Path] = typer.Option(None, "--prices", help="Show this file merged over the defaults."),
           as_json: bool = typer.Option(False, "--json", help="The same tables and the break-even gap as JSON.")) -> None:
    """Print the price table and instance profile as TOML (a starting point for --prices)."""
    from moorage.cost import load_cost_model

    model = load_cost_model(prices_file)
    if as_json:
        typer.echo(json.dumps({"prices": asdict(model.prices), "instance": asdict(model.instance),
                               "break_even_s": model.economics().break_even_s}, indent=2))
        return
    typer.echo(model.to_toml().rstrip())
    typer.echo(f"# break-even idle gap: {model.economics().break_even_s:.1f} s")
