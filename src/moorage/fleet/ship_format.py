"""What a shipped snapshot is in the object store: its manifest's version, the chunk size, the local index's name, the
checks every manifest path and chunk name passes, and the error for a snapshot missing or damaged there."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moorage.errors import MoorageError

CHUNK_BYTES = 4 << 20
INDEX_NAME = ".ship-index.json"
MANIFEST_VERSION = 1
_ZERO = bytes(CHUNK_BYTES)
#: A chunk no manifest of its instance names is deleted only once it is this old (seconds, by the object store's
#: time): a shipment still uploading its chunks (its manifest comes last), on this host or another, is never cut.
ORPHAN_GRACE_S = 3600.0


class SnapshotUnavailable(MoorageError):
    """The shipped snapshot is missing or damaged in the object store; nothing local was changed."""

    code = "snapshot-unavailable"
    http_status = 503


@dataclass
class ShipReport:
    key: str
    files: int
    bytes_total: int
    #: Chunks sent (push) or fetched (pull); the rest were already there.
    chunks_moved: int
    bytes_moved: int
    seconds: float


def _digest_of(data: bytes) -> str | None:
    if data == _ZERO[:len(data)]:
        return None  # a hole: nothing stored, nothing sent
    return hashlib.sha256(data).hexdigest()


def _chunks_of(manifest: dict[str, Any]) -> set[str]:
    return {d for e in manifest.get("entries") or () for d in e.get("chunks") or () if d}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


_BOOT_ID = _boot_id()


def _check_digest(digest: str, key: str) -> str:
    """A chunk name from a manifest is a sha256 (it becomes a key and a file name)."""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise SnapshotUnavailable(f"snapshot manifest {key} names a malformed chunk {digest[:80]!r}")
    return digest


def _safe_rel(path: object, key: str) -> str:
    """A manifest path is relative and stays inside the directory (a damaged or hostile manifest cannot escape)."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\x00" in path:
        raise SnapshotUnavailable(f"snapshot manifest {key} has a malformed path {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise SnapshotUnavailable(f"snapshot manifest {key} has a path outside its directory: {path!r}")
    return path
