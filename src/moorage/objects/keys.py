"""Object keys and content digests: which keys are valid, and the streaming sha256 every backend records.

Keys are '/'-separated segments of ``[A-Za-z0-9_][A-Za-z0-9._=-]*``: no empty, dot-leading or '..' segment, so a
key maps to a plain relative path on every backend and never names a backend's own hidden files.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import BinaryIO

from moorage.errors import InvalidInput

MAX_KEY_LEN = 1024
#: Bytes read or written per step when streaming; bounds what one transfer holds in memory.
CHUNK = 1 << 20

_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9._=-]*"
_KEY_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_PREFIX_RE = re.compile(rf"(?:{_SEGMENT}/)*(?:[A-Za-z0-9_][A-Za-z0-9._=-]*)?")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def check_key(key: str) -> str:
    if not isinstance(key, str) or len(key) > MAX_KEY_LEN or not _KEY_RE.fullmatch(key):
        raise InvalidInput(f"invalid object key {key!r}",
                           hint="use '/'-separated segments of letters, digits and ._=- that do not start with '.' or '-'")
    return key


def check_prefix(prefix: str) -> str:
    """A prefix is a key cut anywhere: whole segments, then optionally the start of one ('' lists everything)."""
    if not isinstance(prefix, str) or len(prefix) > MAX_KEY_LEN or not _PREFIX_RE.fullmatch(prefix):
        raise InvalidInput(f"invalid object key prefix {prefix!r}",
                           hint="a prefix is the beginning of a valid key, e.g. 'instances/t1/' or 'packages/ab'")
    return prefix


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidInput(f"invalid sha256 digest {digest!r}", hint="a digest is 64 lowercase hex characters")
    return digest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_hashing(src: BinaryIO, dst: BinaryIO) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in ``CHUNK`` steps; returns (sha256 hex, bytes copied)."""
    h = hashlib.sha256()
    n = 0
    while chunk := src.read(CHUNK):
        h.update(chunk)
        dst.write(chunk)
        n += len(chunk)
    return h.hexdigest(), n
