"""``moorage checkpoints``: list, take, roll back to and fork checkpoints of one end-user's agent instance.

Each talks to the server through the SDK; a checkpoint holds the sandbox and the store state together.
"""

from __future__ import annotations

import json
from typing import Any, Callable, List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from moorage.cli.console import id_column, make_console, print_table
from moorage.errors import InvalidInput, NotFound

app = typer.Typer(no_args_is_help=True, help="Checkpoints of a user's agent: list, take, roll back, fork.")
console = make_console()
console_err = make_console(stderr=True)
JSON = typer.Option(False, "--json", help="Machine-readable output.")
#: The most checkpoints one listing returns (the API's cap): a name is looked for among the newest this many.
NAME_WINDOW = 500


def _sdk(use: Callable[[Any], Any]) -> Any:
    from moorage.cli.client import sdk
    from moorage.cli.main import state

    return sdk(state.cfg, use)


def _did(c: dict[str, Any]) -> str:
    """One line on what the checkpoint's turn (or operation) did."""
    s = c.get("summary") or {}
    if c.get("restorable") is False and c.get("kind") != "missing":
        return "(cannot be restored: its sandbox half is not there) " + _did({**c, "restorable": None})
    turn = s.get("turn")
    if turn:
        steps = ", ".join(x["name"] for x in turn.get("steps") or [])
        return f"{turn.get('message', '')!r} -> {turn.get('reply', '')!r}" + (f" [{steps}]" if steps else "")
    if "rolled_back_to" in s:
        return f"left for {s['rolled_back_to']}"
    if "forked_from" in s:
        return f"forked from {s['forked_from'].get('user')} at {s['forked_from'].get('checkpoint')}"
    return ""


def _resolve(c: Any, agent: str, user: str, ref: str) -> str:
    """The id of USER's checkpoint ``ref``: an id as it is, or a name that only one of their checkpoints has."""
    listed = c.list_checkpoints(agent, user, limit=NAME_WINDOW)["data"]
    if any(ck["id"] == ref for ck in listed):
        return ref
    named = [ck["id"] for ck in listed if ck.get("name") == ref]
    if len(named) > 1:
        raise InvalidInput(f"{len(named)} checkpoints of user {user!r} of agent {agent!r} are named {ref!r}: "
                           f"{', '.join(named)}", hint="give the id of the one you mean")
    # No such name: an id (perhaps of one older than the listing), which the server knows or answers 404 for.
    return named[0] if named else ref


def _act(agent: str, user: str, ref: str, act: Callable[[Any, str], Any]) -> Any:
    """``act(client, checkpoint_id)`` on the checkpoint ``ref`` names (an id, or a unique name)."""
    from moorage.cli.client import ApiError

    checkpoint_id = _sdk(lambda c: _resolve(c, agent, user, ref))
    try:
        return _sdk(lambda c: act(c, checkpoint_id))
    except ApiError as e:
        if e.status != 404:
            raise
        # The server's hint names its HTTP route; here the way to see them is the CLI's.
        raise NotFound(e.message, hint=f"list them with `moorage checkpoints list {agent} {user}`") from None


def _pages(c: Any, agent: str, user: str, limit: int, cursor: str | None) -> dict[str, Any]:
    """Every page from ``cursor`` on, as one answer: the first page's ``head``, ``branches`` and the rest (they are
    the instance's whole on every page), all the checkpoints in ``data`` and no ``next_cursor``."""
    out = c.list_checkpoints(agent, user, limit=limit, cursor=cursor)
    data, cursor = list(out["data"]), out.get("next_cursor")
    while cursor:
        page = c.list_checkpoints(agent, user, limit=limit, cursor=cursor)
        data.extend(page["data"])
        cursor = page.get("next_cursor")
    return {**out, "data": data, "next_cursor": None}


@app.command("list")
def list_(agent: str, user: str,
          limit: int = typer.Option(50, "--limit", min=1, max=NAME_WINDOW, help="Checkpoints per page (up to 500)."),
          cursor: Optional[str] = typer.Option(None, "--cursor", help="Start after this one: the next_cursor a page "
                                                                      "answered (older checkpoints)."),
          every: bool = typer.Option(False, "--all", help="Read every page (from --cursor, if given)."),
          as_json: bool = JSON) -> None:
    """USER's checkpoints of AGENT, newest first, with what each turn did; then the branches. One page of
    --limit unless --all; a line on stderr names the --cursor of the next, older page."""
    out = _sdk(lambda c: _pages(c, agent, user, limit, cursor) if every
               else c.list_checkpoints(agent, user, limit=limit, cursor=cursor))
    more = out.get("next_cursor")
    if more:  # on stderr: --json's stdout stays one object, and it carries next_cursor itself
        console_err.print(escape(f"showing {len(out['data'])} checkpoints; older ones: `moorage checkpoints list "
                                 f"{agent} {user} --cursor {more}` (or --all)"), highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    table = Table("seq", id_column("id"), "kind", "branch", "name", "what happened")
    for c in out["data"]:
        branch = c["branch"] + ("" if c["current_branch"] else " (history)" if c.get("in_history") else " (abandoned)")
        table.add_row(str(c["seq"]), c["id"], c["kind"], branch, escape(c.get("name") or ""), escape(_did(c)))
    print_table(console, table)
    for b in out["branches"]:
        console.print(f"branch {b['id']}: {b['checkpoints']} checkpoints, tip {b['tip'] or '(none yet)'}"
                      + (" (current)" if b["current"] else " (abandoned: `moorage checkpoints rollback` to its tip)"))


@app.command("take")
def take(agent: str, user: str, name: Optional[str] = typer.Option(None, "--name", help="Kept by retention."),
         as_json: bool = JSON) -> None:
    """Checkpoint USER's instance of AGENT now."""
    out = _sdk(lambda c: c.take_checkpoint(agent, user, name=name))
    print(json.dumps(out, indent=2) if as_json else out["id"])


@app.command("rollback")
def rollback(agent: str, user: str, checkpoint: str, as_json: bool = JSON) -> None:
    """Roll USER's instance of AGENT back to CHECKPOINT, an id or a name (files, processes, memory, facts, journal)."""
    out = _act(agent, user, checkpoint, lambda c, ck: c.rollback_checkpoint(agent, user, ck))
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"rolled back to {out['rolled_back_to']} in {out['ms']} ms; the state it left is checkpoint "
          f"{out['abandoned']['tip']} (branch {out['abandoned']['branch']})")


@app.command("fork")
def fork(agent: str, user: str, checkpoint: str,
         to: List[str] = typer.Option(..., "--to", help="A new end-user (repeat for several)."),
         as_json: bool = JSON) -> None:
    """Fork USER's instance of AGENT at CHECKPOINT (an id or a name) into new end-users."""
    out = _act(agent, user, checkpoint, lambda c, ck: c.fork_checkpoint(agent, user, ck, to))
    if as_json:
        print(json.dumps(out, indent=2))
        return
    for f in out["forks"]:
        print(f"{f['user']}: {f['rows']} rows copied, sandbox {f['sandbox_id']}, first checkpoint {f['checkpoint']}")
