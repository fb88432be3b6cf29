"""``moorage store``: operator commands for the durable store (runs on the host, not over HTTP).

Creating tenants, migrating, sweeping expired data: things an operator does with direct store access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moorage.cli.console import make_console
from moorage.config import Config

console = make_console()
err_console = make_console(stderr=True)
app = typer.Typer(no_args_is_help=True, help="Operator commands for the durable store.")
#: How a host gets its store: what a command that only reads says when there is none yet.
NO_STORE_HINT = "`moorage up` makes it with a local tenant, `moorage store migrate` makes it empty"


def store_missing(cfg: Config) -> Optional[Path]:
    """Where the embedded (SQLite) store would be, when it has not been made yet; None when it exists or the store
    is a server's (PostgreSQL). Commands that only read check this first: opening a store makes one."""
    url = cfg.store_url
    if url not in ("sqlite", "") and not url.startswith("sqlite:"):
        return None
    path = url.removeprefix("sqlite:").removeprefix("//") if url.startswith("sqlite:") else ""
    root = Path(path) if path else cfg.data_dir / "store"  # as moorage.store.open_backend places it
    return None if (root / "control.db").exists() else root


def _store():  # type: ignore[no-untyped-def]
    from moorage.cli.main import state
    from moorage.store import open_store

    return open_store(state.cfg)


def _existing() -> bool:
    """False, having said there is no store yet and how to make one, where there is none."""
    from moorage.cli.main import state

    missing = store_missing(state.cfg)
    if missing is not None:
        err_console.print(f"no store yet at {missing} ({NO_STORE_HINT})", highlight=False, soft_wrap=True)
    return missing is None


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Which backend and schema version this host's store runs."""
    from moorage.cli.main import state
    from moorage.errors import NotFound

    missing = store_missing(state.cfg)
    if missing is not None:  # nothing to describe: a failure a script can see, and no store made
        raise NotFound(f"no store yet at {missing}", hint=NO_STORE_HINT)
    with _store() as s:
        described, version = s.describe(), s.backend.schema_version()
    if as_json:
        print(json.dumps({"store": described, "schema_version": version}))
        return
    console.print(described, highlight=False)
    console.print(f"control schema v{version}", highlight=False)


@app.command()
def migrate() -> None:
    """Bring the schema up to date (opening the store does this; this makes it explicit)."""
    with _store() as s:
        console.print(f"up to date: {s.describe()}")


@app.command()
def sweep(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Delete data whose retention TTL has passed, in every tenant."""
    scopes = rows = 0
    if _existing():  # no store, nothing expired: said on stderr, and a sweep of nothing
        with _store() as s:
            rep = s.operator.sweep_all()
        scopes, rows = rep.scopes, rep.rows
    if as_json:
        print(json.dumps({"scopes": scopes, "rows": rows}))
    else:
        console.print(f"swept {scopes} expired scopes ({rows} rows)")


@app.command("create-tenant")
def create_tenant(name: str,
                  as_json: bool = typer.Option(False, "--json", help="The tenant and its admin key as JSON.")) -> None:
    """Create a tenant and print its first admin API key (shown once; only a hash is kept)."""
    from moorage.errors import ConflictError

    with _store() as s:
        try:
            t, key = s.operator.create_tenant(name)
        except ConflictError as e:
            raise ConflictError(e.message, hint="choose another name; `moorage store tenants` lists those taken "
                                                "(an existing tenant's first admin key is not shown again)") from None
    if as_json:
        print(json.dumps({"tenant": t.id, "name": t.name, "api_key": key.secret}))
    else:
        console.print(f"tenant {t.name} ({t.id})\nadmin key: {key.secret}\n[dim]store it now: it is not shown again[/]")


@app.command("delete-tenant")
def delete_tenant(name: str = typer.Argument(..., help="The tenant's name or id."),
                  yes: bool = typer.Option(False, "--yes", help="Do not ask."),
                  as_json: bool = typer.Option(False, "--json", help="The API's answer.")) -> None:
    """Delete a tenant and everything it has: its keys (and the end-user tokens they issued), agents, end-users,
    instances and store. Asks the `moorage up` of this data directory (DELETE /v1/tenants/NAME, with the operator
    token), which stops its instances; progress on stderr."""
    from urllib.parse import quote

    from moorage.cli.client import follow, operator_stream
    from moorage.cli.main import state

    if not yes and not typer.confirm(f"delete tenant {name} with all of its agents, users and keys?", err=True):
        raise typer.Exit(1)
    with err_console.status(f"deleting {name}…") as status:
        events = operator_stream(state.cfg, "DELETE", f"/v1/tenants/{quote(name, safe='')}", "deleted")
        r = follow(events, status, "deleting", name, "deleted",
                   hint="`moorage store tenants` shows whether it is gone; delete it again to finish")
    if as_json:
        print(json.dumps(r, indent=2))
    else:
        console.print(f"deleted tenant {r['tenant']['name']} ({r['tenant']['id']}): agents {r['agents']}, "
                      f"end-users forgotten {r['users']}, keys revoked {r['keys_revoked']}", highlight=False)


@app.command("tenants")
def tenants(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List tenants, with the limits the operator gave each (``tenant-limits``)."""
    rows: list[tuple] = []
    if _existing():
        with _store() as s:
            rows = [(t, s.operator.tenant_limits(t.id)) for t in s.operator.list_tenants()]
    if as_json:
        print(json.dumps({"data": [{"id": t.id, "name": t.name, "created_at": t.created_at, "limits": limits,
                                    "deleting_since": t.deleting_since} for t, limits in rows]}))
    else:
        for t, limits in rows:
            own = "  ".join(f"{k}={v:g}" for k, v in sorted(limits.items()))
            gone = "\t(being deleted: `moorage store delete-tenant` finishes it)" if t.deleting_since else ""
            console.print(f"{t.name}\t{t.id}" + (f"\t{own}" if own else "") + gone, highlight=False)


@app.command("tenant-limits")
def tenant_limits(name: str = typer.Argument(..., help="The tenant's name or id."),
                  storage_mib: Optional[float] = typer.Option(
                      None, "--storage-mib", min=0,
                      help="What the tenant may keep, in MiB: its store and its instances' disks (0: no ceiling)."),
                  default: bool = typer.Option(False, "--default",
                                               help="Clear the tenant's own value: tenant_max_storage_mib applies."),
                  as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Show or set one tenant's own limits, which replace the installation's defaults for it (a running host
    applies a change within a minute)."""
    from moorage.cli.main import state
    from moorage.errors import InvalidInput

    if default and storage_mib is not None:
        raise InvalidInput("give --storage-mib or --default, not both",
                           hint="--default clears the tenant's own value; --storage-mib N sets it")
    if not _existing():
        raise typer.Exit(1)
    with _store() as s:
        if default or storage_mib is not None:
            s.operator.set_tenant_limits(name, storage_mib=None if default else storage_mib)
        t = s.operator.get_tenant(name)
        limits = s.operator.tenant_limits(t.id)
    fallback = float(state.cfg.tenant_max_storage_mib or 0)
    mib = limits.get("storage_mib", fallback)
    if as_json:
        print(json.dumps({"tenant": t.id, "name": t.name, "limits": limits, "storage_mib": mib or None}))
        return
    whose = "its own" if "storage_mib" in limits else "tenant_max_storage_mib, the default"
    console.print(f"{t.name}: storage ceiling {f'{mib:g} MiB' if mib else 'none'} ({whose})", highlight=False)
