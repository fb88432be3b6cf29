"""Test helper: which files under a directory hold a byte string (for "nothing left on disk" checks)."""

from __future__ import annotations

import os
from pathlib import Path


def files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if needle in p.read_bytes():
                hits.append(p)
    return hits
