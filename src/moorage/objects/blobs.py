"""Content-addressed objects: a blob is stored under the sha256 of its bytes, so every host agrees what a key holds.

Putting the same bytes twice (or from two hosts at once) is safe and stores one object.
"""

from __future__ import annotations

from pathlib import Path

from moorage.objects.errors import ObjectExists
from moorage.objects.keys import check_digest, check_key, sha256_file
from moorage.objects.store import ObjectInfo, ObjectStore


class Blobs:
    """Blobs under ``prefix``: key ``<prefix>/<sha256 hex><suffix>`` (e.g. ``packages/<sha>.tar.gz``)."""

    def __init__(self, store: ObjectStore, prefix: str = "blobs", *, suffix: str = "") -> None:
        check_key(f"{prefix}/x{suffix}")
        self.store = store
        self.prefix = prefix
        self.suffix = suffix

    def key(self, digest: str) -> str:
        return f"{self.prefix}/{check_digest(digest)}{self.suffix}"

    def put_blob(self, path: Path) -> str:
        """Store the file unless its bytes are already there; returns their sha256 (hex)."""
        digest = sha256_file(Path(path))
        key = self.key(digest)
        if self.store.exists(key):
            return digest  # same key, same bytes: nothing to send
        try:
            # if-absent where the backend has it: of two hosts racing, one writes and the other reads theirs.
            self.store.put_file(key, Path(path), if_absent=self.store.supports_if_absent, sha256=digest)
        except ObjectExists:
            pass
        return digest

    def get_blob(self, digest: str, dest: Path) -> ObjectInfo:
        """Write the blob to ``dest``, verified against its digest (``ObjectNotFound``, ``ObjectCorrupt``)."""
        return self.store.get_file(self.key(digest), Path(dest), sha256=digest)

    def has(self, digest: str) -> bool:
        return self.store.exists(self.key(digest))

    def delete(self, digest: str) -> None:
        self.store.delete(self.key(digest))
