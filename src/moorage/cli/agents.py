"""``moorage agents``: the tenant's deployed agents, each with its live deployment; ``moorage agents delete``.

Reads ``GET /v1/agents`` (and each agent's deployments, for the live one's number) through the SDK.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import typer
from rich.markup import escape
from rich.table import Table

from moorage.cli.console import make_console, print_table, utc

console = make_console()
err_console = make_console(stderr=True)


def register(app: typer.Typer, cfg_of: Callable[[], Any]) -> None:
    """Attach ``moorage agents`` to the main app (``cfg_of()`` returns the loaded Config)."""
    group = typer.Typer(invoke_without_command=True, help="The tenant's agents: list them (on its own), delete one.")
    app.add_typer(group, name="agents")

    @group.command("delete")
    def delete(agent: str, yes: bool = typer.Option(False, "--yes", help="Do not ask."),
               as_json: bool = typer.Option(False, "--json", help="The API's answer.")) -> None:
        """Delete AGENT and everything it kept: every end-user of it forgotten, its deployments, secrets, webhooks
        and traces; keys bound to it revoked. The name is then free for a new agent."""
        from moorage.cli.client import follow, sdk

        # The question goes to stderr: stdout holds only the answer (with --json, one JSON document).
        if not yes and not typer.confirm(f"delete agent {agent} and forget all of its users?", err=True):
            raise typer.Exit(1)
        with err_console.status(f"deleting {agent}…") as status:
            # How far it got on stderr as it goes (an agent with many users takes a while).
            r = sdk(cfg_of(), lambda c: follow(c.delete_agent_stream(agent), status, "deleting", agent, "deleted",
                                               hint=f"`moorage agents` shows whether {agent} is gone; delete it "
                                                    "again to finish"),
                    hint="`moorage agents` lists them")
        if as_json:
            print(json.dumps(r, indent=2))
        else:
            console.print(escape(f"deleted agent {agent} (users forgotten: {r['users']}, records removed: {r['removed']})"))

    @group.callback()
    def agents(ctx: typer.Context,
               as_json: bool = typer.Option(False, "--json", help="The API's list (GET /v1/agents), each agent with "
                                                                  "the table's live_number and deployments too.")) -> None:
        """The agents deployed in this tenant: live deployment, how many deployments, last change (UTC)."""
        if ctx.invoked_subcommand is not None:
            return
        from moorage.cli.client import sdk

        def read(c: Any) -> tuple[list[Any], dict[str, list[Any]]]:
            found = list(c.paginate(c.list_agents))
            return found, {a["name"]: list(c.paginate(c.list_deployments, a["name"])) for a in found}

        found, deployments = sdk(cfg_of(), read)
        # What the table shows beside the API's fields: the live deployment's number and how many there are.
        rows = [{**a, "live_number": next((d["number"] for d in deployments[a["name"]]
                                           if d["id"] == a.get("live_deployment")), None),
                 "deployments": len(deployments[a["name"]])} for a in found]
        if as_json:
            print(json.dumps({"data": rows}, indent=2))
            return
        if not rows:
            console.print("no agents yet: deploy one with `moorage deploy FOLDER`", highlight=False)
            return
        table = Table("agent", "live", "deployments", "updated")
        for a in rows:
            live = "(none live)" if a["live_number"] is None else f"#{a['live_number']}"
            if (a.get("config") or {}).get("deleting"):  # a delete cut short: `moorage agents delete` finishes it
                live += " (being deleted)"
            table.add_row(escape(a["name"]), live, str(a["deployments"]), utc(a.get("updated_at")))
        print_table(console, table)
