"""``moorage share AGENT USER``: a link that opens one user's app without an API key; list and revoke them.

The link's token is shown once, when it is made (the server keeps only its record); ``--revoke`` stops it at once.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

import typer
from rich.table import Table

from moorage.cli.console import id_column, make_console, print_table, utc
from moorage.errors import InvalidInput

console = make_console()
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if m is None:
        raise InvalidInput(f"cannot read a duration from {text!r}", hint="write e.g. 90s, 15m, 1h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def register(app: typer.Typer, cfg_of: Callable[[], Any]) -> None:
    """Attach ``moorage share`` to the main app (``cfg_of()`` returns the loaded Config)."""

    @app.command()
    def share(agent: str = typer.Argument(..., help="The agent whose app to share."),
              user: str = typer.Argument(..., help="The end-user whose instance serves it."),
              ttl: str = typer.Option("1h", "--ttl", help="How long the link works: 90s, 15m, 1h, 7d."),
              label: str = typer.Option("", "--label", help="A note for whoever lists the links."),
              list_: bool = typer.Option(False, "--list", help="List this user's links instead (never their tokens)."),
              revoke: Optional[str] = typer.Option(None, "--revoke", metavar="LINK_ID", help="Revoke one link."),
              as_json: bool = typer.Option(False, "--json", help="The link (or the list) as JSON.")) -> None:
        """Make a signed, expiring link to USER's app of AGENT (declared with ports = [...] in moorage.toml)."""
        from moorage.cli.client import sdk
        from moorage.client._local import server

        cfg = cfg_of()
        if revoke:
            out = sdk(cfg, lambda c: c.revoke_share_link(agent, user, revoke),
                      hint=f"`moorage share {agent} {user} --list` lists this user's links")
            print(json.dumps(out, indent=2) if as_json else f"revoked {out.get('id', revoke)}")
            return
        if list_:
            listed = sdk(cfg, lambda c: c.list_share_links(agent, user))
            if as_json:
                print(json.dumps(listed, indent=2))
                return
            table = Table(id_column("id"), "label", "expires", "revoked")
            for r in listed["data"]:
                table.add_row(r["id"], r["label"], utc(r["expires_at"]), utc(r["revoked_at"]))
            print_table(console, table)
            return
        seconds = parse_ttl(ttl)
        out = dict(sdk(cfg, lambda c: c.create_share_link(agent, user, ttl_s=seconds, label=label)))
        out["url"] = server(cfg)[0].rstrip("/") + out["url"]  # where the command's own request went
        print(json.dumps(out, indent=2) if as_json else out["url"])
