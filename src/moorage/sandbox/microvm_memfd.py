"""Sealed in-memory copies of template RAM files: what forks' QEMUs map instead of the files themselves.

QEMU 7.2 opens a ``memory-backend-file`` read-write even to map it privately, so a fork given its template's RAM
file could write the RAM every sibling maps. It gets a memfd sealed against writes instead (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moorage.log import get_logger

log = get_logger(__name__)

#: Once these are set nobody (root included) can write, punch, shrink or grow the memfd, map it shared and
#: writable, or remove a seal; private writable mappings (copy-on-write) stay allowed, which is all a fork needs.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_COPY_BYTES = 4 << 20


@dataclass(frozen=True)
class SealedRam:
    """One template RAM file's sealed copy. ``fd`` belongs to the cache: lease a duplicate, never close it."""

    fd: int
    name: str
    key: tuple[int, int, int, int]
    size: int
    copied_bytes: int
    build_ms: float


_lock = threading.Lock()
_cache: dict[str, SealedRam] = {}
_building: dict[str, threading.Lock] = {}


def _key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def memfd_name(path: Path) -> str | None:
    """The name a template RAM file's memfd carries (``/memfd:<name> (deleted)`` in a QEMU's maps), or None when
    the file is gone. Made from the file's path and inode, so a host restarted finds the mappings of QEMUs an
    earlier host process started."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    tag = hashlib.sha256(f"{Path(path).resolve()}\0{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:16]
    return f"moorage-template-ram-{tag}"


def sealed_ram(path: Path) -> SealedRam:
    """The sealed memfd holding ``path``'s bytes, made on first use in this process (a copy of its data extents:
    holes stay holes) and kept until ``release``. A file changed since (another inode, size or mtime) gets a new
    one."""
    path = Path(path).resolve()
    key = str(path)
    with _lock:
        entry = _cache.get(key)
        build_lock = _building.setdefault(key, threading.Lock())
    st = os.stat(path)
    if entry is not None and entry.key == _key(st):
        return entry
    with build_lock:  # one copy per file at a time; a second caller waits for it and uses it
        st = os.stat(path)
        with _lock:
            entry = _cache.get(key)
        if entry is not None and entry.key == _key(st):
            return entry
        fresh = _build(path, st)
        with _lock:
            old = [e for e in (_cache.get(key),) if e is not None]
            _cache[key] = fresh
            # Copies of files gone meanwhile (a template another host process collected) go too, so none is kept
            # for longer than until the next copy is made.
            for k in [k for k in _cache if k != key and not os.path.exists(k)]:
                old.append(_cache.pop(k))
                _building.pop(k, None)
        for entry in old:  # QEMUs that mapped an old copy keep their own reference to it
            os.close(entry.fd)
    return fresh


def ready(path: Path) -> bool:
    """Whether ``path``'s sealed copy is made and current (one stat: cheap enough for the event loop)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    with _lock:
        entry = _cache.get(str(Path(path).resolve()))
    return entry is not None and entry.key == _key(st)


def lease(path: Path) -> int:
    """A new descriptor (close-on-exec; the caller closes it) of ``path``'s sealed memfd, made if need be."""
    while True:
        entry = sealed_ram(path)
        with _lock:
            if _cache.get(str(Path(path).resolve())) is entry:
                return os.dup(entry.fd)  # under the lock: ``release`` cannot close it in between


def open_for_reading(path: Path) -> int:
    """A descriptor to read ``path``'s bytes from: its sealed memfd when this process has one that is current (no
    second copy in the page cache), the file itself otherwise. The caller closes it."""
    key = str(Path(path).resolve())
    with _lock:
        entry = _cache.get(key)
        if entry is not None:
            with contextlib.suppress(OSError):
                if entry.key == _key(os.stat(path)):
                    return os.dup(entry.fd)
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def release(path: Path) -> None:
    """Drop this process's sealed copy of ``path`` (its template is gone, or is forked rarely: ``cool_template``). A
    QEMU that maps it keeps its own."""
    key = str(Path(path).resolve())
    with _lock:
        entry = _cache.pop(key, None)
        _building.pop(key, None)
    if entry is not None:
        os.close(entry.fd)


def release_under(root: Path) -> None:
    """Drop every sealed copy of a file under ``root`` (a driver closing)."""
    prefix = str(Path(root).resolve()) + os.sep
    with _lock:
        gone = [k for k in _cache if k.startswith(prefix)]
        entries = [_cache.pop(k) for k in gone]
        for k in gone:
            _building.pop(k, None)
    for entry in entries:
        os.close(entry.fd)


def cached() -> dict[str, SealedRam]:
    """The sealed copies this process holds, by file path (for stats and tests)."""
    with _lock:
        return dict(_cache)


def _build(path: Path, st: os.stat_result) -> SealedRam:
    t0 = time.monotonic()
    name = memfd_name(path) or "moorage-template-ram"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _key(os.fstat(src)) != _key(st):
                raise FileNotFoundError(f"{path} was replaced while it was being opened")
            # Exactly the file's size: QEMU refuses a backing store of another size, and could not grow a sealed one.
            os.ftruncate(fd, st.st_size)
            copied = _copy_extents(src, fd, st.st_size)
            if _key(os.fstat(src)) != _key(st):
                raise FileNotFoundError(f"{path} changed while it was being copied")
            # The file's pages were only read for this copy: forks map the memfd, so the page cache need not
            # hold the same bytes a second time (clean pages: dropping them loses nothing).
            with contextlib.suppress(OSError):
                os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(src)
        _seal(fd)
    except BaseException:
        os.close(fd)
        raise
    ms = (time.monotonic() - t0) * 1000
    log.info("template RAM sealed in memory", path=str(path), bytes=st.st_size, copied=copied, ms=round(ms, 1))
    return SealedRam(fd, name, _key(st), st.st_size, copied, ms)


def _seal(fd: int, tries: int = 20) -> None:
    """Seal the copy. The kernel refuses a write seal (EBUSY) while some page of the file still has an extra
    reference after its own short wait (seen under load: CI of session 21, with DAMON scanning pages); the pages
    were only written by this process with ``pwrite``, so waiting a little and trying again is all it takes."""
    for i in range(tries):
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or i == tries - 1:
                raise
            time.sleep(0.01 * (i + 1))


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each data extent of a sparse file of ``size`` bytes, in order; holes are skipped."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        pos = end


def _copy_extents(src: int, dst: int, size: int) -> int:
    """Copy the data extents of ``src`` into ``dst`` at the same offsets (holes are skipped); returns bytes copied."""
    copied = 0
    view = memoryview(bytearray(_COPY_BYTES))
    for start, end in data_extents(src, size):
        off = start
        while off < end:
            n = os.preadv(src, [view[: min(_COPY_BYTES, end - off)]], off)
            if n <= 0:
                raise OSError(f"short read at {off} of a {size}-byte file")
            done = 0
            while done < n:
                done += os.pwrite(dst, view[done:n], off + done)
            off += n
        copied += end - start
    return copied
