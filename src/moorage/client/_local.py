"""What a client on the machine where ``moorage up`` runs finds in its data directory: the ``local`` tenant's admin
key, and the address the running host serves at (``moorage-up.json``, written as it starts serving, removed as it stops).

The SDK's ``Client()`` and the CLI find them the same way, here: the configuration the CLI reads (``MOORAGE_CONFIG``
or ``./moorage.toml``, then the ``MOORAGE_*`` variables: its ``data_dir``, ``api_url``, ``api_key``, ``host`` and
``port``) names the data directory. The record is read only while the process that wrote it lives: one left by a
host that crashed names a pid that is gone, and is ignored. Whatever address a client ends up with, it says where it
came from (``Settings.url_from``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from moorage.config import Config

#: The names a server on this machine answers to: only to these (and to the address the running ``moorage up``
#: recorded, on this machine by construction) is the local admin key ever sent.
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
#: The record of where ``moorage up`` serves, in its data directory.
SERVING = "moorage-up.json"


def local_config() -> "Config":
    """The configuration the CLI run here reads (``moorage.config.load``): ``MOORAGE_CONFIG`` or ``./moorage.toml``,
    then the ``MOORAGE_*`` variables. Its ``data_dir`` is where ``moorage up`` keeps its admin key and address:
    ``MOORAGE_DATA_DIR``, else ``data_dir`` in the file, else ``$XDG_DATA_HOME/moorage``, else
    ``~/.local/share/moorage``. Raises ConfigError, as the CLI does, for a file it cannot read."""
    from moorage import config

    return config.load()


def server(cfg: "Config") -> tuple[str, str]:
    """The server's URL and where it came from: ``api_url`` (MOORAGE_API_URL) if set, else where the ``moorage up``
    running on the data directory said it serves (a record whose process is gone is passed over), else the
    configured ``host``:``port`` (``http://127.0.0.1:7700`` by default)."""
    if cfg.api_url:
        return cfg.api_url, "api_url / MOORAGE_API_URL"
    recorded = served_url(cfg.data_dir)
    if recorded is not None:
        return recorded
    return (local_url(cfg.host, cfg.port), f"host and port of the config: no running `moorage up` recorded its "
                                           f"address in {cfg.data_dir / SERVING}")


def on_this_machine(url: str, data_dir: Path) -> bool:
    """Whether ``url`` is a server on this machine: a loopback name, or where the ``moorage up`` of ``data_dir``
    said it serves. Only such a server is ever sent the local admin key."""
    recorded = served_url(data_dir)
    return (urlsplit(url).hostname or "") in LOOPBACK or (recorded is not None and recorded[0] == url.rstrip("/"))


def local_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server listening on ``host:port`` at (a wildcard address is
    reached on loopback; an IPv6 address goes in brackets)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def record_serving(data_dir: Path, url: str) -> Path:
    """Write where this process serves (``moorage up``, once it listens), replacing any earlier record whole."""
    path = data_dir / SERVING
    tmp = path.with_name(f".{SERVING}.{os.getpid()}")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}) + "\n")
    tmp.replace(path)
    return path


def forget_serving(data_dir: Path) -> None:
    """Remove the record as the host stops serving, if it is still this process's own."""
    path = data_dir / SERVING
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def served_url(data_dir: Path) -> tuple[str, str] | None:
    """The URL the ``moorage up`` holding ``data_dir`` serves at and a note of where it came from, or None when no
    host there is running (no record, or one whose process is gone: a crash leaves it behind)."""
    path = data_dir / SERVING
    try:
        record = json.loads(path.read_text())
        url, pid = record["url"], int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not _alive(pid):
        return None
    return url, f"where `moorage up` (pid {pid}) said it serves, in {path}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


def local_admin_key(url: str, data_dir: Path) -> str | None:
    """The ``local`` tenant's admin key that the ``moorage up`` of ``data_dir`` wrote, for a client of a server on
    this machine that was given no key (None for any other server, or when there is no such file): a script run
    beside ``moorage up`` works as the CLI does, and the key never leaves the machine."""
    if not on_this_machine(url, data_dir):
        return None
    try:
        return (data_dir / "local-admin.key").read_text().strip() or None
    except OSError:
        return None
