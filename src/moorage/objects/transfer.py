"""Pieces of a transfer: a window of a file as a stream of its own, hashing a stream, waiting for parallel parts.

Used by the S3 backend's multipart uploads and ranged downloads.
"""

from __future__ import annotations

import hashlib
import io
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from pathlib import Path
from typing import Any, BinaryIO

from moorage.objects.keys import CHUNK


def wait_all(futures: list[Future[Any]]) -> None:
    """Wait for every transfer step; on the first failure cancel the ones not started and raise it."""
    finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in finished and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()
        wait(futures)
        raise failed.exception()  # type: ignore[misc]


class FileWindow(io.RawIOBase):
    """``length`` bytes of a file from ``start``, as a seekable stream of its own (one upload part)."""

    def __init__(self, path: Path, start: int, length: int) -> None:
        super().__init__()
        self._f = open(path, "rb")
        self._start, self._len, self._pos = start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        left = self._len - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._f.close()
        super().close()


def hash_stream(f: io.BufferedIOBase | BinaryIO) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    while chunk := f.read(CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n
