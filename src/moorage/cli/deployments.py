"""``moorage deployments``: list an agent's deployments and delete the ones no longer wanted (their packages stop
counting toward the tenant's storage). Each talks to the server through the SDK."""

from __future__ import annotations

import json
from typing import Any, Callable

import typer
from rich.markup import escape
from rich.table import Table

from moorage.cli.console import id_column, make_console, print_table, utc

app = typer.Typer(no_args_is_help=True, help="An agent's deployments: list them, delete old ones.")
console = make_console()
JSON = typer.Option(False, "--json", help="Machine-readable output.")


def _sdk(use: Callable[[Any], Any], hint: str | None = None) -> Any:
    from moorage.cli.client import sdk
    from moorage.cli.main import state

    return sdk(state.cfg, use, hint=hint)


@app.command("list")
def list_(agent: str, as_json: bool = JSON) -> None:
    """AGENT's deployments, oldest first: number, status, which one is live, the package's digest, when (UTC)."""
    def read(c: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return c.get_agent(agent), list(c.paginate(c.list_deployments, agent))

    found, deps = _sdk(read)
    if as_json:
        print(json.dumps({"data": deps}, indent=2))
        return
    table = Table("number", "status", "live", id_column("package"), "created")
    for d in deps:
        table.add_row(str(d["number"]), d["status"], "yes" if d["id"] == found.get("live_deployment") else "",
                      d["package_sha256"][:16], utc(d.get("created_at")))
    print_table(console, table)


@app.command("delete")
def delete(agent: str, number: int = typer.Argument(..., min=1, help="The deployment's number."),
           as_json: bool = JSON) -> None:
    """Delete deployment NUMBER of AGENT (not the live one): it can no longer be rolled back to, and its package
    stops counting toward the tenant's storage (the file goes at the host's next collection)."""
    d = _sdk(lambda c: c.delete_deployment(agent, number),
             hint=f"`moorage deployments list {agent}` shows them; roll back or deploy first to delete the live one")
    if as_json:
        print(json.dumps(d, indent=2))
    else:
        console.print(escape(f"deleted deployment #{d['number']} of {agent}"))
