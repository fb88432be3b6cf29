"""Files the host writes under its data directory (packages, template records): private and all-or-nothing.

Directories are 0700 and files 0600, so other local users read nothing of a tenant's code or provenance;
each file is written to a temp name, fsynced and renamed, so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) as 0700; an existing directory with a wider mode is narrowed."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, DIR_MODE)
    return path


def data_dir(path: Path) -> Path:
    """The host's data directory, made private; one it cannot make is a configuration error naming it."""
    try:
        return private_dir(path)
    except OSError as e:
        from moorage.errors import ConfigError

        raise ConfigError(f"cannot make the data directory {path}: {e.strerror}",
                          hint="set data_dir in moorage.toml or MOORAGE_DATA_DIR to a directory this user can "
                               "write") from None


def write_private(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` as a 0600 file, atomically (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
