"""``moorage backup DEST``: a copy of a stopped host's data directory, taken under the lock ``moorage up`` holds,
so no host runs on it during the copy (docs/operations.md says why a running host's directory is not copied)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable

import typer

from moorage.config import Config
from moorage.errors import ConfigError, ConflictError, InvalidInput, MoorageError

#: States in which an instance's files or memory are not (all) on disk: a host crashed, or stopped with --detach.
AWAKE = ("running", "waking", "suspending", "provisioning")


def awake_instances(cfg: Config) -> list[str]:
    """Scopes of the instances the embedded store records awake."""
    from moorage.store import open_store

    store = open_store(cfg)
    try:
        return [f"{r.scope.key} ({r.state})" for ts in store.operator.tenants() for r in ts.sandboxes.list()
                if r.state in AWAKE]
    finally:
        store.close()


def backup(cfg: Config, dest: Path, *, force: bool = False) -> None:
    """Copy ``cfg.data_dir`` to ``dest`` (which must not exist) with ``cp -a``, holding the host's lock."""
    from moorage.cli.up import hold_data_dir

    if cfg.store_url not in ("sqlite", ""):
        raise InvalidInput(f"this host's store is not in its data directory (store_url = {cfg.store_url})",
                           hint="stop the host, back up the database (pg_dump) and copy the data directory with cp -a")
    if not (cfg.data_dir / "store").is_dir():
        raise InvalidInput(f"{cfg.data_dir} holds no moorage store", hint="name the data directory with --data-dir")
    if dest.exists() or dest.is_symlink():
        raise InvalidInput(f"{dest} already exists", hint="name a directory that does not exist yet")
    try:
        fd = hold_data_dir(cfg)
    except ConfigError as e:
        raise ConflictError(f"moorage up is running on {cfg.data_dir}: {e}",
                            hint="stop it first (SIGTERM or Ctrl-C puts awake agents to sleep); a copy taken while "
                                 "it runs is not consistent (docs/operations.md)") from None
    try:
        awake = awake_instances(cfg)
        if awake and not force:
            raise ConflictError(f"{len(awake)} instance(s) recorded awake, their memory not on disk: "
                                + ", ".join(awake[:5]),
                                hint="start moorage up without --detach and stop it (they are put to sleep), or "
                                     "pass --force to copy their disks as they are")
        r = subprocess.run(["cp", "-a", "--sparse=always", "--", str(cfg.data_dir), str(dest)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise MoorageError(f"copying {cfg.data_dir} to {dest} failed: {r.stderr.strip()}",
                               hint=f"remove {dest} and run the backup again")
    finally:
        os.close(fd)


def register(app: typer.Typer, cfg_of: Callable[[], Config]) -> None:
    @app.command("backup")
    def backup_cmd(dest: Path = typer.Argument(..., help="A new directory to copy the data directory to."),
                   force: bool = typer.Option(False, "--force", help="Copy even when instances are recorded awake.")
                   ) -> None:
        """Copy the data directory of a stopped host (docs/operations.md); restore by starting on the copy."""
        cfg = cfg_of()
        backup(cfg, dest, force=force)
        typer.echo(f"backed up {cfg.data_dir} to {dest}")
