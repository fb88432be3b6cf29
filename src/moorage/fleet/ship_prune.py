"""Pruning an instance's shipped snapshots: keep the newest few, delete the older ones with the chunks only they used,
and the chunks of shipments that failed midway (no manifest names them) once they are older than a grace period."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from moorage.fleet.ship_format import ORPHAN_GRACE_S, SnapshotUnavailable, _chunks_of
from moorage.objects import ObjectNotFound, ObjectStore


class Pruning:
    """The prune of ``Shipper`` (a mixin: the shipper holds the store, reads manifests and keeps the local index)."""

    store: ObjectStore
    read_manifest: Callable[[str], dict[str, Any]]
    _chunk_key: Callable[[str, str], str]
    _load_index: Callable[[Path], dict[str, Any]]
    _save_index: Callable[[Path, dict[str, Any]], None]

    def prune(self, src: Path, prefix: str, *, keep: int, orphan_grace_s: float = ORPHAN_GRACE_S) -> tuple[int, int]:
        """Delete the snapshots under ``prefix`` but the newest ``keep`` (names sort by epoch, then time), and the
        chunks that only they used; ``src`` is the directory last pushed there. Then delete the chunks no remaining
        manifest names that are older than ``orphan_grace_s`` (what shipments that failed midway left). Returns
        (snapshots, chunks) deleted.

        Blocking, and serialised with pushes to ``prefix`` by the caller. Chunks go before their manifest, so an
        interrupted prune is finished by the next one; a manifest that cannot be read stops it (nothing of a
        snapshot that may still be needed is ever guessed away)."""
        if keep < 1:
            raise ValueError("keep at least the newest snapshot")
        snapshots, chunks = self._drop_old(src, prefix, keep)
        return snapshots, chunks + self._drop_orphans(src, prefix, orphan_grace_s)

    def _drop_old(self, src: Path, prefix: str, keep: int) -> tuple[int, int]:
        names = sorted(o.key for o in self.store.iter(f"{prefix}/snapshots/"))
        if len(names) <= keep:
            return 0, 0
        kept, dropped = names[-keep:], names[:-keep]
        referenced = {d for k in kept for d in _chunks_of(self.read_manifest(k))}
        # This directory's index must not believe in chunks about to go: a later push would skip sending them.
        index = self._load_index(src)
        stored = index.get("stored", {}).get(prefix)
        if isinstance(stored, list):
            index["stored"] = {prefix: sorted(set(stored) & referenced)}
            self._save_index(src, index)
        chunks = 0
        for key in dropped:
            try:
                unused = _chunks_of(self.read_manifest(key)) - referenced
            except SnapshotUnavailable:
                unused = set()  # a damaged old manifest: it goes, its chunks wait for ``delete_prefix``
            for digest in sorted(unused):
                self.store.delete(self._chunk_key(prefix, digest))  # a missing one (an earlier try) is no error
                chunks += 1
            self.store.delete(key)
        return len(dropped), chunks

    def _drop_orphans(self, src: Path, prefix: str, grace_s: float) -> int:
        """Delete the chunks under ``prefix`` that no manifest there names and that are older than ``grace_s``.

        Chunks belong to one instance (its prefix): only its own manifests can name them. Chunks are listed before
        the manifests, so a manifest written meanwhile is read; each candidate is looked at again just before it
        goes (a push that reuses an old leftover writes it again, which makes it young). A manifest that cannot be
        read leaves every chunk where it is."""
        cutoff = time.time() - grace_s
        old = [o.key for o in self.store.iter(f"{prefix}/chunks/") if o.modified < cutoff]
        if not old:
            return 0
        named: set[str] = set()
        for o in self.store.iter(f"{prefix}/snapshots/"):
            try:
                named |= _chunks_of(self.read_manifest(o.key))
            except SnapshotUnavailable:
                return 0  # it may still name some of them: nothing is guessed away
        gone: set[str] = set()
        for key in old:
            digest = key.rsplit("/", 1)[1]
            if digest in named:
                continue
            try:
                if self.store.head(key).modified >= cutoff:
                    continue  # written again since it was listed: a shipment in progress counts on it
            except ObjectNotFound:
                continue
            self.store.delete(key)
            gone.add(digest)
        index = self._load_index(src)
        stored = index.get("stored", {}).get(prefix)
        if gone and isinstance(stored, list):
            index["stored"] = {prefix: sorted(set(stored) - gone)}
            self._save_index(src, index)
        return len(gone)
