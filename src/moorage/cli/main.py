"""Entry point of the ``moorage`` command: parses arguments, loads config once, renders results.

Sub-command groups live in their own modules and are attached here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from moorage.cli.console import make_console
from moorage.cli.errors import OneLineErrors
from moorage import __version__, config as config_mod, log

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False, help="moorage: persistent per-user AI agents, one micro-VM each.")
console = make_console()
err_console = make_console(stderr=True)


class State:
    cfg: config_mod.Config


state = State()


@app.callback()
def _main(
    config: Optional[Path] = typer.Option(None, "--config", metavar="FILE", help="Path to moorage.toml (settings under a \\[moorage] table)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", metavar="DIR", help="Data directory (default: $XDG_DATA_HOME/moorage, or ~/.local/share/moorage "
                                                        "where XDG_DATA_HOME is unset; MOORAGE_DATA_DIR sets it too)."),
    log_level: Optional[str] = typer.Option(None, "--log-level", metavar="LEVEL", help="debug, info, warning or error "
                                            "(MOORAGE_LOG_LEVEL sets it too)."),
) -> None:
    state.cfg = config_mod.load(config, data_dir=data_dir, log_level=log_level)
    log.configure(state.cfg.log_level, state.cfg.log_format)


@app.command()
def version(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Print moorage's version."""
    if as_json:
        print(json.dumps({"version": __version__}))
        return
    console.print(__version__)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Check this host: QEMU, whether KVM really boots a guest, bubblewrap, disk, store."""
    from moorage.cli.doctor import run_checks

    checks = run_checks(state.cfg)
    if as_json:
        print(json.dumps({"data": [c.__dict__ for c in checks]}, indent=2))
    else:
        for c in checks:
            mark = "[green]ok  [/]" if c.ok else ("[yellow]warn[/]" if c.optional else "[red]FAIL[/]")
            line = f"{mark} {c.name:<11} {c.detail}"
            if not c.ok and c.fix:
                line += f"  [dim]→ fix: {c.fix}[/]"
            console.print(line, highlight=False)
    if any(not c.ok and not c.optional for c in checks):
        raise typer.Exit(1)


@app.command()
def up(
    demo: Optional[Path] = typer.Option(None, "--demo", help="Deploy this agent folder and hold a short conversation with it."),
    exit_after_demo: bool = typer.Option(False, "--exit-after-demo", help="Stop once the demo conversation is done."),
    host: Optional[str] = typer.Option(None, "--host", help="The address to listen on (default 127.0.0.1; 0.0.0.0: "
                                       "every interface)."),
    port: Optional[int] = typer.Option(None, "--port", help="The port to listen on (default 7700; 0: a free one, "
                                       "said at start; the CLI and Client() here find it)."),
    detach: bool = typer.Option(False, "--detach", help="On stop, leave awake micro-VMs running (a live upgrade; "
                                "the next start re-adopts them) instead of putting them to sleep."),
    store_url: Optional[str] = typer.Option(None, "--store-url", help="A postgresql:// store shared with other hosts."),
    object_store_url: Optional[str] = typer.Option(None, "--object-store-url",
                                                   help="s3://bucket/prefix shared with other hosts (with --store-url: join a fleet)."),
    host_id: Optional[str] = typer.Option(None, "--host-id", help="This host's unique id in the fleet."),
) -> None:
    """Run moorage on this machine with the embedded defaults and serve the HTTP API."""
    import asyncio

    from moorage.cli.up import serve

    cfg = state.cfg.with_(**{k: v for k, v in (("host", host), ("port", port), ("store_url", store_url),
                                               ("object_store_url", object_store_url), ("host_id", host_id))
                             if v is not None})
    if detach:
        cfg = cfg.with_(shutdown="detach")
    try:
        asyncio.run(serve(cfg, demo, exit_after_demo))
    except KeyboardInterrupt:
        pass


BENCH_SCRIPTS = {
    "store": ["store/run.py"],
    "memory": ["memory/run.py"],
    "durable": ["durable/run.py"],
    "lifecycle": ["lifecycle/run_sim.py", "lifecycle/wake_storm.py"],
    "sandbox": ["sandbox/run.py", "sandbox/egress.py", "sandbox/vm_network.py"],
    "api": ["api/run.py"],
    "e2e": ["e2e/run.py"],
    "fleet": ["fleet/run.py"],
    "attacks": ["attacks/run.py"],
    "llm": ["llm/run.py"],
    "timetravel": ["timetravel/run.py"],
    "soak": ["soak/run.py"],
}


@app.command()
def bench(area: str = typer.Argument(..., help=f"One of: {', '.join(BENCH_SCRIPTS)}"),
          quick: bool = typer.Option(False, "--quick", help="Fewer repetitions (a smoke run).")) -> None:
    """Run one benchmark area; reports land in bench/results/latest/ and the last line is the headline."""
    import subprocess

    if area not in BENCH_SCRIPTS:
        from moorage.errors import InvalidInput

        raise InvalidInput(f"unknown benchmark area {area!r}", hint=f"choose one of {', '.join(BENCH_SCRIPTS)}")
    root = Path(__file__).resolve().parents[3] / "bench"
    if not root.is_dir():
        err_console.print("[red]error:[/] the benchmarks ship with the source checkout (bench/); run from there")
        raise typer.Exit(2)
    missing = missing_test_extras()
    if missing:  # the benchmarks run peers and clients (dbos, openai, a real S3 server) the host itself does not need
        from moorage.errors import UnavailableError

        raise UnavailableError(f"`moorage bench` needs the test packages: {', '.join(missing[:4])}"
                               f"{', ...' if len(missing) > 4 else ''} not installed",
                               hint="run `bash scripts/test.sh` once (it installs them), or "
                                    "`bash scripts/bootstrap.sh --test`")
    for script in BENCH_SCRIPTS[area]:
        # bench/sandbox takes its sizes as numbers; the others have a --quick switch.
        small = ["--reps", "5", "--forks", "2", "--cold", "1"] if area == "sandbox" else ["--quick"]
        argv = [sys.executable, str(root / script)] + (small if quick else [])
        rc = subprocess.call(argv, cwd=root.parent)
        if rc != 0:
            raise typer.Exit(rc)


def missing_test_extras() -> list[str]:
    """The distributions of moorage's ``test`` extra that are not installed (``scripts/up.sh`` installs none)."""
    import importlib.metadata as md
    import re

    missing = []
    for req in md.requires("moorage") or []:
        if "extra" in req and re.search(r"extra\s*==\s*['\"]test['\"]", req):
            name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0]
            try:
                md.version(name)
            except md.PackageNotFoundError:
                missing.append(name)
    return missing


# Sub-command groups, one module each under moorage/cli/ exposing a ``typer.Typer`` named ``app``.
SUBCOMMANDS = {
    "image": "moorage.cli.image",
    "cost": "moorage.cli.cost",
    "memory": "moorage.cli.memory",
    "llm": "moorage.cli.llm",
    "store": "moorage.cli.store",
    "secrets": "moorage.cli.secrets",
    "checkpoints": "moorage.cli.checkpoints",
    "deployments": "moorage.cli.deployments",
    "hosts": "moorage.cli.hosts",
}


def _attach_subcommands() -> None:
    import importlib
    import importlib.util

    for name, module in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            app.add_typer(importlib.import_module(module).app, name=name)


_attach_subcommands()
# `moorage host drain` reads as naturally as `moorage hosts drain`: the same group under both names.
from moorage.cli import hosts as _hosts  # noqa: E402

app.add_typer(_hosts.app, name="host", hidden=True)

from moorage.cli import client as _client  # noqa: E402

_client.register(app, lambda: state.cfg)

from moorage.cli import share as _share  # noqa: E402

_share.register(app, lambda: state.cfg)

from moorage.cli import agents as _agents  # noqa: E402

_agents.register(app, lambda: state.cfg)

from moorage.cli import backup as _backup  # noqa: E402

_backup.register(app, lambda: state.cfg)


def run() -> None:
    """Console entry point. Failures are one clear line, not a traceback: ``OneLineErrors`` (the root command) says
    them, for every way the CLI is run."""
    app()


if __name__ == "__main__":
    # `python -m moorage.cli.main`: run the module's importable copy, whose `state` the sub-command groups read.
    from moorage.cli.main import run as _run

    _run()
