"""``moorage hosts``: the fleet's hosts with their state, heartbeat age, load and instances (direct store access).

An operator command: it reads the shared store the hosts register in (``--store-url`` / MOORAGE_STORE_URL).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import typer

from moorage.cli.console import make_console

console = make_console()
app = typer.Typer(invoke_without_command=True, help="The fleet's hosts (operator, direct store access).")


@app.callback()
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List the hosts with their state, heartbeat age, load and the instances each holds."""
    if ctx.invoked_subcommand is not None:
        return
    from moorage.cli.main import state
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    with open_store(state.cfg) as store:
        rows = HostRegistry(store.backend).list()
        held: Counter[tuple[str, str]] = Counter()
        for ts in store.operator.tenants():
            for host, st, n in ts.read("SELECT host, state, COUNT(*) FROM sandboxes GROUP BY host, state"):
                held[(host or "", st)] += int(n)
    now = time.time()
    out = []
    for h in rows:
        mine = {st: n for (host, st), n in held.items() if host == h.id}
        alive = h.alive(state.cfg.lease_ttl_s, now)
        out.append({"id": h.id, "url": h.url, "state": h.state if alive or h.state == "gone" else "lapsed",
                    "heartbeat_age_s": round(now - h.heartbeat_at, 1), "load": h.load, "instances": mine})
    if as_json:
        print(json.dumps(out))
        return
    if not out:
        console.print("no hosts have registered (a host joins a fleet with a PostgreSQL store and an object store)")
    for h in out:
        inst = ", ".join(f"{n} {st}" for st, n in sorted(h["instances"].items())) or "no instances"
        console.print(f"{h['id']}\t{h['state']}\t{h['url']}\theartbeat {h['heartbeat_age_s']} s ago\t"
                      f"awake {h['load'].get('awake', 0)}\t{inst}")


@app.command()
def drain(host_id: str = typer.Argument(..., help="The host to drain (see `moorage hosts`).")) -> None:
    """Drain a host for an upgrade: it sleeps and ships every instance (new ones start elsewhere), then exits."""
    from moorage.cli.main import state
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    with open_store(state.cfg) as store:
        HostRegistry(store.backend).set_state(host_id, "draining")
    console.print(f"{host_id} is draining: it sleeps its instances and leaves within a heartbeat or two")
