"""``moorage backup DEST``: a copy of the data directory that a host started on it serves from. A stopped host's
is copied under the lock ``moorage up`` holds; a running host is asked, over its local admin socket, to take an
online backup (``runtime/backup.py``: each instance at one point of its own, no downtime). docs/operations.md."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

import typer

from moorage.config import Config
from moorage.errors import ConfigError, ConflictError, InvalidInput

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


def online_backup(cfg: Config, dest: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Ask the ``moorage up`` running on ``cfg.data_dir`` to back itself up into ``dest``; echo its progress."""
    from moorage.runtime.admin_socket import socket_path
    from moorage.runtime.backup import BackupFailed

    path = socket_path(cfg.data_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError as e:
        sock.close()
        raise ConflictError(f"moorage up is running on {cfg.data_dir} and cannot be asked for an online backup "
                            f"({path}: {e.strerror})",
                            hint="a host started by an older moorage, or on a data directory whose path is too long "
                                 "for a socket, has none: stop it and run moorage backup again") from None
    with sock, sock.makefile("rwb") as f:
        f.write(json.dumps({"op": "backup", "dest": str(dest)}).encode() + b"\n")
        f.flush()
        for line in f:
            event = json.loads(line)
            kind = event.get("event")
            if kind == "start":
                echo(f"online backup of {cfg.data_dir}: {event['total']} instance(s) of {event['tenants']} tenant(s)")
            elif kind == "instance":
                echo(f"  {event['done']}/{event['total']} {event['instance']}")
            elif kind == "done":
                return event
            elif kind == "error":
                raise BackupFailed(event.get("message") or "the online backup failed", hint=event.get("hint"))
    raise BackupFailed(f"the host stopped answering before the backup was done: {dest} is incomplete (it holds "
                       f"moorage-backup.incomplete, and moorage up refuses to start on it)",
                       hint=f"check the host's log, remove {dest} and take the backup again")


def backup(cfg: Config, dest: Path, *, force: bool = False, echo: Callable[[str], None] = print) -> str:
    """Copy ``cfg.data_dir`` to ``dest`` (which must not exist): with ``cp -a`` holding the host's lock when no host
    runs on it, else as an online backup the running host takes. Returns how ("stopped", or "online: ...")."""
    from moorage.cli.up import hold_data_dir

    if cfg.store_url not in ("sqlite", ""):
        raise InvalidInput(f"this host's store is not in its data directory (store_url = {cfg.store_url})",
                           hint="stop the host, back up the database (pg_dump) and copy the data directory with cp -a")
    if not (cfg.data_dir / "store").is_dir():
        raise InvalidInput(f"{cfg.data_dir} holds no moorage store", hint="name the data directory with --data-dir")
    if dest.exists() or dest.is_symlink():
        raise InvalidInput(f"{dest} already exists", hint="name a directory that does not exist yet")
    dest = Path(os.path.abspath(dest))
    try:
        fd = hold_data_dir(cfg)
    except ConfigError:  # moorage up runs on it: that host takes the copy
        done = online_backup(cfg, dest, echo)
        return f"online: {done['instances']} instance(s) in {done['seconds']:.1f} s"
    try:
        awake = awake_instances(cfg)
        if awake and not force:
            raise ConflictError(f"{len(awake)} instance(s) recorded awake, their memory not on disk: "
                                + ", ".join(awake[:5]),
                                hint="start moorage up without --detach and stop it (they are put to sleep), or "
                                     "pass --force to copy their disks as they are")
        from moorage.runtime.backup_files import BackupFailed, copy_but_booted

        try:  # cp -a, without the booted templates (a cache: the copy's first deploy of each size boots again)
            asyncio.run(copy_but_booted(cfg.data_dir, dest))
        except BackupFailed as e:
            raise BackupFailed(f"{e.message} (backing up {cfg.data_dir} to {dest})",
                               hint=f"remove {dest}, free space there (or fix its permissions) and run the backup "
                                    "again") from None
    finally:
        os.close(fd)
    return "stopped"


def register(app: typer.Typer, cfg_of: Callable[[], Config]) -> None:
    @app.command("backup")
    def backup_cmd(dest: Path = typer.Argument(..., help="A new directory to copy the data directory to."),
                   force: bool = typer.Option(False, "--force", help="Stopped host: copy even when instances are "
                                                                     "recorded awake (a crashed host).")
                   ) -> None:
        """Back up the data directory; restore by starting moorage up on the copy (docs/operations.md).

        Host running: an online backup, no downtime; each user's files, memory and store rows from one point.

        One instance at a time sleeps after its turn, is copied and let go; progress: instances copied / total.

        A backup cut short leaves DEST marked incomplete: moorage up refuses it. A stopped host: cp -a, locked."""
        cfg = cfg_of()
        how = backup(cfg, dest, force=force, echo=typer.echo)
        typer.echo(f"backed up {cfg.data_dir} to {dest}" + (f" ({how})" if how != "stopped" else ""))
