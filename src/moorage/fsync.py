"""Durable directory entries: after a rename or create in a directory, its own ``fsync`` makes the new name survive
a crash (a file's data is synced with the file; its name lives in the directory)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path | str) -> None:
    """``fsync`` the directory ``path``, so the entries just made or renamed in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
