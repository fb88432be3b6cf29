"""``moorage secrets``: set, list and remove an agent's secrets through the server; rotate the operator's key.

A value is read from standard input or a hidden prompt, never from the command line (shell history, ps).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer
from rich.table import Table

from moorage.cli.console import make_console, utc

app = typer.Typer(no_args_is_help=True, help="Agent secrets: stored encrypted, added by the host, never shown.")
console = make_console()

USER = typer.Option(None, "--user", "-u", help="One end-user's own secret (default: the agent's, for every user).")


def _cfg() -> Any:
    from moorage.cli.main import state

    return state.cfg


@app.command("set")
def set_(agent: str, name: str, user: Optional[str] = USER) -> None:
    """Set NAME for AGENT; the value comes from standard input (or a hidden prompt). A new value is used from
    the agent's next request on; nothing is rebuilt."""
    from moorage.cli.client import sdk

    if sys.stdin.isatty():
        value = typer.prompt(f"value of {name}", hide_input=True)
    else:
        value = sys.stdin.read()
    value = value.rstrip("\r\n")  # `echo $TOKEN | moorage secrets set ...` ends in a newline
    info = sdk(_cfg(), lambda c: c.set_secret(agent, name, value, user=user))
    console.print(f"[green]set[/] {name} for {agent}{' user ' + user if user else ''} (version {info['version']})",
                  highlight=False)


@app.command("list")
def list_(agent: str, user: Optional[str] = USER,
          as_json: bool = typer.Option(False, "--json", help="Machine-readable output (never a value).")) -> None:
    """List AGENT's secrets: names, versions and when they changed (never values)."""
    import json

    from moorage.cli.client import sdk

    listed = sdk(_cfg(), lambda c: c.list_secrets(agent, user=user))
    if as_json:
        print(json.dumps(listed, indent=2))
        return
    table = Table("name", "version", "updated")
    for r in listed["data"]:
        table.add_row(r["name"], str(r["version"]), utc(r["updated_at"]))
    console.print(table)


@app.command("rm")
def rm(agent: str, name: str, user: Optional[str] = USER) -> None:
    """Remove NAME from AGENT (requests stop carrying it at once)."""
    from moorage.cli.client import sdk

    sdk(_cfg(), lambda c: c.delete_secret(agent, name, user=user))
    console.print(f"[green]removed[/] {name} from {agent}", highlight=False)


@app.command("rotate-key")
def rotate_key() -> None:
    """Operator: put a new encryption key first in the data directory's key file (or use the first of
    secrets_keys) and re-encrypt every tenant's secrets under it. Old keys stay for reading; restart servers
    so that they encrypt new values with the new key."""
    from moorage.cli.store import NO_STORE_HINT, store_missing
    from moorage.errors import NotFound
    from moorage.secrets import KEY_FILE_NAME, SecretStore, rotate_key_file
    from moorage.store import open_store

    cfg = _cfg()
    missing = store_missing(cfg)
    if missing is not None:  # opening one would make it: a mistyped --data-dir must not get a store and a key
        raise NotFound(f"no store yet at {missing}, so no secrets to re-encrypt; nothing was changed",
                       hint=f"check --data-dir / MOORAGE_DATA_DIR ({NO_STORE_HINT})")
    if cfg.secrets_keys:
        # The keys live in the config: the operator put the new one first there; re-encrypt under it.
        note = "keys from secrets_keys"
    else:
        path = cfg.data_dir / KEY_FILE_NAME
        note = f"new key {rotate_key_file(path)} in {path}"
    secrets = SecretStore.from_config(cfg)
    store = open_store(cfg)
    moved = 0
    try:
        for ts in store.operator.tenants():
            moved += secrets.reencrypt(ts)
    finally:
        store.close()
    console.print(f"{note}; {moved} secrets re-encrypted under key {secrets.keyring.primary}", highlight=False)
