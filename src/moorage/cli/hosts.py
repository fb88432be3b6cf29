"""``moorage hosts``: the fleet's hosts with their state, heartbeat age, load and instances (direct store access).

An operator command: it reads the shared PostgreSQL store the hosts register in (``--store-url`` /
MOORAGE_STORE_URL); without one it says so (it never opens or creates a local store).
"""

from __future__ import annotations

import json
import time
from collections import Counter

from typing import Optional

import typer

from moorage.cli.console import make_console

console = make_console()
app = typer.Typer(invoke_without_command=True, help="The fleet's hosts (operator, direct store access).")


def _fleet_config(store_url: str | None):  # type: ignore[no-untyped-def]
    """The configuration with the fleet's shared store; a command here never opens (or creates) a local one."""
    from moorage.cli.main import state
    from moorage.errors import ConfigError

    cfg = state.cfg.with_(store_url=store_url) if store_url else state.cfg
    if not cfg.store_url.startswith(("postgresql://", "postgres://")):
        given = f"the store is {cfg.store_url!r}, not one" if cfg.store_url != "sqlite" else "none is configured"
        raise ConfigError(f"moorage hosts reads the fleet's shared PostgreSQL store, and {given}",
                          hint="pass --store-url postgresql://... or set MOORAGE_STORE_URL (as the hosts have)")
    return cfg


STORE_URL = typer.Option(None, "--store-url", help="The fleet's PostgreSQL store (default: MOORAGE_STORE_URL).")


@app.callback()
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
          store_url: Optional[str] = STORE_URL) -> None:
    """List the hosts with their state, heartbeat age, load and the instances each holds."""
    from moorage.cli.main import state

    if ctx.invoked_subcommand is not None:  # a sub-command (drain) checks the store, given before or after it
        if store_url:
            state.cfg = state.cfg.with_(store_url=store_url)
        return
    cfg = _fleet_config(store_url)
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    with open_store(cfg) as store:
        rows = HostRegistry(store.backend).list()
        held: Counter[tuple[str, str]] = Counter()
        for ts in store.operator.tenants():
            for host, st, n in ts.read("SELECT host, state, COUNT(*) FROM sandboxes GROUP BY host, state"):
                held[(host or "", st)] += int(n)
    now = time.time()
    out = []
    for h in rows:
        mine = {st: n for (host, st), n in held.items() if host == h.id}
        alive = h.alive(cfg.lease_ttl_s, now)
        out.append({"id": h.id, "url": h.url, "state": h.state if alive or h.state == "gone" else "lapsed",
                    "heartbeat_age_s": round(now - h.heartbeat_at, 1),
                    "load": h.load if alive else {},  # what a host that left last said is no load
                    "instances": mine})
    if as_json:
        print(json.dumps({"data": out}))
        return
    if not out:
        console.print("no hosts have registered (a host joins a fleet with a PostgreSQL store and an object store)")
    for h in out:
        inst = ", ".join(f"{n} {st}" for st, n in sorted(h["instances"].items())) or "no instances"
        console.print(f"{h['id']}\t{h['state']}\t{h['url']}\theartbeat {h['heartbeat_age_s']} s ago\t"
                      f"awake {h['load'].get('awake', 0)}\t{inst}")


@app.command()
def drain(host_id: str = typer.Argument(..., help="The host to drain (see `moorage hosts`)."),
          store_url: Optional[str] = STORE_URL) -> None:
    """Drain a host for an upgrade: it sleeps and ships every instance (new ones start elsewhere), then exits."""
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    from moorage.errors import NotFound

    with open_store(_fleet_config(store_url)) as store:
        try:
            HostRegistry(store.backend).set_state(host_id, "draining")
        except NotFound as e:
            raise NotFound(e.message, hint="`moorage hosts` lists the fleet's hosts") from None
    console.print(f"{host_id} is draining: it sleeps its instances and leaves within a heartbeat or two")
