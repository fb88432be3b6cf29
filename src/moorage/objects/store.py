"""The object-store interface every backend implements, and what it returns.

Transfers stream in bounded chunks (never a whole object in memory); every get verifies the sha256 recorded at put.
"""

from __future__ import annotations

import io
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from moorage.errors import InvalidInput
from moorage.objects.keys import check_key, copy_hashing


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: sha256 hex recorded at put; None in listings (S3 lists do not carry user metadata).
    sha256: str | None
    #: Last modification, seconds since the epoch.
    modified: float


@dataclass(frozen=True)
class ObjectPage:
    objects: list[ObjectInfo]
    #: Pass as ``after`` to get the next page; None when this was the last one.
    next_token: str | None


class ObjectStore(ABC):
    """Keyed blobs with verified, streaming transfers. Thread-safe; call from async code via ``asyncio.to_thread``.

    Keys are checked by ``moorage.objects.keys.check_key``. A key must not also be the "folder" of another key
    (``a/b`` and ``a/b/c`` together): the local backend cannot store both.
    """

    #: Where the objects live, for messages (``file:///...`` or ``s3://bucket/prefix``).
    url: str

    # -- writing --------------------------------------------------------------------------------------

    @abstractmethod
    def put_file(self, key: str, path: Path, *, if_absent: bool = False, sha256: str | None = None) -> ObjectInfo:
        """Store the file at ``path`` under ``key`` (atomically: readers see the old object or the new one).

        ``if_absent``: raise ``ObjectExists`` instead of replacing an existing object. ``sha256``: the caller
        already knows the file's digest (saves a read pass); a wrong one is refused (``InvalidInput``) where the
        backend can tell while storing, and otherwise makes every later get raise ``ObjectCorrupt``: it never
        returns the bytes. The file must not change while it is stored.
        """

    def put_stream(self, key: str, stream: BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        """Store everything read from ``stream``. Spooled to a temp file first: the digest is recorded up front."""
        check_key(key)
        fd, name = tempfile.mkstemp(prefix="moorage-put-", dir=self._spool_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                digest, _ = copy_hashing(stream, f)
            return self.put_file(key, Path(name), if_absent=if_absent, sha256=digest)
        finally:
            os.unlink(name)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> ObjectInfo:
        """Store a small value (metadata, manifests); big things go through ``put_file``."""
        return self.put_stream(key, io.BytesIO(data), if_absent=if_absent)

    # -- reading --------------------------------------------------------------------------------------

    @abstractmethod
    def get_file(self, key: str, dest: Path, *, sha256: str | None = None) -> ObjectInfo:
        """Write the object to ``dest`` (mode 0600), verified before ``dest`` appears; replaces ``dest`` atomically.

        ``sha256``: also require the recorded digest to be this one (content-addressed keys). Raises
        ``ObjectNotFound`` or ``ObjectCorrupt``; on either, ``dest`` is left as it was. ``dest``'s folder must exist.
        """

    @abstractmethod
    def get_stream(self, key: str, out: BinaryIO) -> ObjectInfo:
        """Write the object to ``out`` as it arrives and verify it at the end.

        On ``ObjectCorrupt`` some bytes were already written: treat ``out``'s content as untrusted until this
        returns. Use ``get_file`` where a half-written destination matters.
        """

    def get_bytes(self, key: str, *, max_bytes: int = 16 << 20) -> bytes:
        """A small object's bytes, verified. Refuses objects over ``max_bytes`` (use ``get_file``)."""
        info = self.head(key)
        if info.size > max_bytes:
            raise InvalidInput(f"object {key!r} is {info.size} bytes, over the {max_bytes} read in memory",
                               hint="read it with get_file")
        buf = io.BytesIO()
        self.get_stream(key, buf)
        return buf.getvalue()

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """The object's size, digest and time, without its bytes; raises ``ObjectNotFound``."""

    def exists(self, key: str) -> bool:
        from moorage.objects.errors import ObjectNotFound

        try:
            self.head(key)
            return True
        except ObjectNotFound:
            return False

    # -- listing and deleting -------------------------------------------------------------------------

    @abstractmethod
    def list(self, prefix: str = "", *, after: str | None = None, limit: int = 1000) -> ObjectPage:
        """Objects whose key starts with ``prefix`` (a plain string prefix), at most ``limit``, in key order.

        Paging with ``after=page.next_token`` yields every key once. Key order is byte order, except that some
        S3-compatible servers (SeaweedFS) list folder by folder: ``a/b`` before ``a-c``. Do not rely on it there.
        """

    def iter(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, page by page."""
        after: str | None = None
        while True:
            page = self.list(prefix, after=after)
            yield from page.objects
            if page.next_token is None:
                return
            after = page.next_token

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; returns how many were removed. An empty prefix is refused."""

    @abstractmethod
    def sweep_incomplete(self, older_than_s: float = 24 * 3600) -> int:
        """Remove what writers that died mid-put left behind (temp files, unfinished multipart uploads) that is
        older than ``older_than_s``; returns how many. Never touches a finished object."""

    # -- capabilities and lifetime ------------------------------------------------------------------

    @property
    def supports_if_absent(self) -> bool:
        """Whether ``if_absent=True`` is honoured (otherwise it raises ``ObjectStoreUnsupported``)."""
        return True

    def check(self) -> None:
        """Fail now, with a clear error, if the store cannot be used as configured (unreachable, no bucket, ...)."""

    def close(self) -> None:
        """Release connections; the store is unusable afterwards."""

    def __enter__(self) -> "ObjectStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spool_dir(self) -> str | None:
        """Directory for temp files of ``put_stream`` (None: the system's)."""
        return None


def check_limit(limit: int) -> int:
    if not 1 <= limit <= 1000:
        raise InvalidInput(f"list limit {limit} is out of range", hint="ask for 1 to 1000 objects per page")
    return limit


def check_delete_prefix(prefix: str) -> str:
    if not prefix:
        raise InvalidInput("refusing to delete every object (empty prefix)", hint="name the prefix to delete")
    return prefix

