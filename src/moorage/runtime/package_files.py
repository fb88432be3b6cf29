"""The deploy packages on this host's disk (``<data>/packages/<sha256>.tar.gz``, one per package however many
tenants and deployments name it), and their collection: a file no deployment of any tenant names any more (each one
that did was deleted, by hand or by ``[agent.retention] keep_deployments``) goes at the host's next collection of
templates (``Templates.collect``). A deploy holds its package (``saving``) from before the file is written until a
deployment names it, so a collection that read the store before that never takes it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

from moorage.log import get_logger

log = get_logger(__name__)

SUFFIX = ".tar.gz"


class PackageFiles:
    """One host's package files and the deploys writing them now."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._saving: dict[str, int] = {}

    @contextlib.contextmanager
    def saving(self, sha256: str) -> Iterator[None]:
        """Hold ``sha256``'s file against the collection while a deploy writes it and records its deployment."""
        self._saving[sha256] = self._saving.get(sha256, 0) + 1
        try:
            yield
        finally:
            left = self._saving[sha256] - 1
            if left:
                self._saving[sha256] = left
            else:
                del self._saving[sha256]

    def collect(self, named: frozenset[str] | None, *, read_at: float, grace_s: float,
                now: float | None = None) -> int:
        """Delete the package files no deployment names (``named``: read from every tenant at ``read_at``; None: not
        read, nothing goes), unless a deploy holds one, or it was written less than ``grace_s`` ago or after the
        store was read. Returns how many went."""
        if named is None or not self.root.is_dir():
            return 0
        now = time.time() if now is None else now
        removed = 0
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            sha = path.name[:-len(SUFFIX)]
            if sha in named or sha in self._saving:
                continue
            try:
                written = path.stat().st_mtime
                if now - written < grace_s or written >= read_at - 1.0:
                    continue
                path.unlink()
            except OSError:
                continue
            removed += 1
            log.info("a package no deployment names any more deleted from this host", package=sha[:16])
        return removed
