"""Append-only segment files for one SQLite tenant's large LangGraph channel values.

A value stored in a SQLite table is written twice (to the WAL, then into the database file at the
checkpoint) plus the B-tree's overflow pages. A value in the blob log is written once: the group-commit
leader appends the whole batch's large values with one ``pwritev`` and one ``fdatasync``, and the
transaction that commits afterwards stores only a 24-byte locator per value. Durability is unchanged: the
bytes are on disk before any row can refer to them.

Rules that keep it correct:

- Appends happen only inside a write transaction of the tenant's database (``BEGIN IMMEDIATE`` holds the
  file's single writer lock), so appends from threads and processes never interleave. The vacuum needs
  that lock only to unlink a segment: rows refer only to records below the recorded end and appends go
  only at or above it, so what no row of one read snapshot refers to below that snapshot's end is garbage
  for good, and the scan of every row and the punching run while writers go on.
- The end of the log (segment, offset) is a row of the tenant database (``lg_log``, migration 7),
  advanced by the same transaction that commits the rows pointing at the new values: space written by a
  transaction that rolled back or never committed (crash) is simply written over by the next append.
- Appends go into space zero-filled ahead of them (at least ``_PREFILL``, room for eight batches, filled
  in the same ``fdatasync`` as the batch that found less than two batches' room left):
  ``fdatasync`` of data written over already-allocated, already-written blocks needs no filesystem journal
  commit, while every append that grew the file did, and a journal commit waits for other files' data
  (measured here with another process writing: append + fdatasync of 1 MiB p50 3.0 ms, the same write
  into zero-filled space 0.39 ms). The zeros are bytes written too, as many as the data: a batch of at
  least ``_ZERO_FILL_MAX`` bytes, whose own transfer outweighs a journal commit, does not refill the space
  (measured, 8 writers of 256 KiB-value states, 4 MiB per batch: 1,550-1,790 puts/s refilling,
  1,730-2,160 not; one 1 MiB append on a quiet disk: 0.37-0.45 ms into zero-filled space, 0.64-0.72 ms
  growing the file).
- Deleted values are punched out of the file (``fallocate(PUNCH_HOLE)``: the blocks are freed and read
  back as zeros), so forgetting a thread leaves none of its bytes in the files; a segment with nothing
  live is unlinked.
- Appended bytes do not stay in the page cache beyond the newest ``cache_keep`` bytes of the log (the
  values a resumed thread is likely to read next): once durable, older ranges are dropped with
  ``posix_fadvise(DONTNEED)``, as PostgreSQL does with WAL segments it no longer needs. A checkpoint log is
  written far more than it is read, and leaving every appended byte cached grows the cache by the write
  rate: measured here, sustained 256 KiB-state puts fell to about 60% of their speed once ~2 GB had been
  appended (the kernel's page-cache copy dominated), and stayed level with the window.
- Each record carries a header (magic, length, random id) that its locator repeats: a read of a range
  that was punched or reused fails with ``BlobGone`` instead of returning someone else's bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Sequence

from moorage.errors import MoorageError
from moorage.fsync import fsync_dir

_MAGIC = b"MLG1"
_HEADER = struct.Struct("<4sIQ")  # magic, value length, record id
#: A locator as stored in lg_blobs.blob: segment, offset of the record header, value length, record id.
LOCATOR = struct.Struct("<IQIQ")
_SEGMENT_MAX = 1 << 30
_IOV_MAX = 512
_PREFILL = 4 << 20
_ZERO_FILL_MAX = 2 << 20
_ZEROS = bytes(1 << 20)
_EDGE = 8192
_CACHE_KEEP = 16 << 20
_DROP_ALIGN = 2 << 20
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class BlobGone(MoorageError):
    """A locator's record is not (or no longer) in the log: it was deleted, or the file was damaged."""


def _libc_fallocate():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


def _punch(fd: int, off: int, length: int) -> None:
    """Free ``length`` bytes at ``off`` (they read back as zeros), or overwrite them with zeros where the
    filesystem cannot punch holes."""
    if length <= 0:
        return
    if _fallocate is not None and _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, length) == 0:
        return
    err = ctypes.get_errno() if _fallocate is not None else errno.EOPNOTSUPP
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS, 0):
        raise OSError(err, os.strerror(err))
    zeros = bytes(min(length, 1 << 20))
    done = 0
    while done < length:
        done += os.pwrite(fd, zeros[: min(len(zeros), length - done)], off + done)


#: lg_blobs.type / lg_writes.type prefix of a value held in the log; the row's blob then holds its locator.
LOG_TYPE = "log:"
#: SQL predicate: the row's value is held in the log (its blob column is a locator).
LOGGED = f"type LIKE '{LOG_TYPE}%'"


def live_locators(c: Any, thread_id: str | None = None) -> list[bytes]:
    """Locators of every log-held value in lg_blobs and lg_writes (of one thread, or all), inside the
    caller's transaction."""
    where = LOGGED + ("" if thread_id is None else " AND thread_id = ?")
    params = () if thread_id is None else (thread_id,)
    return [r[0] for table in ("lg_blobs", "lg_writes") for r in c.q(f"SELECT blob FROM {table} WHERE {where}", params)]


def load_position(c: Any) -> tuple[int, int] | None:
    """The log's recorded end, inside the caller's transaction (``c``: a store ``Conn``)."""
    row = c.one("SELECT segment, end_offset FROM lg_log WHERE id = 0")
    return None if row is None else (int(row[0]), int(row[1]))


def store_position(c: Any, position: tuple[int, int]) -> None:
    c.x("INSERT INTO lg_log (id, segment, end_offset) VALUES (0, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET segment = excluded.segment, end_offset = excluded.end_offset", position)


class BlobLog:
    """One tenant's blob log: numbered segment files in ``directory`` (created on the first append)."""

    def __init__(self, directory: Path, segment_max: int = _SEGMENT_MAX, cache_keep: int = _CACHE_KEEP) -> None:
        self.directory = Path(directory)
        self._segment_max = max(1, segment_max)
        self._cache_keep = max(0, cache_keep)
        self._uncached = (-1, 0)  # (segment, offset): the write descriptor's pages below it were dropped
        self._mu = threading.Lock()
        self._write: tuple[int, int] | None = None  # (segment, fd) appends go to
        self._readers: dict[int, int] = {}

    # -- paths and descriptors ------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.directory / f"{seg:08d}.seg"

    def segments(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(n[:-4]) for n in names if n.endswith(".seg") and n[:-4].isdigit())

    def _open_segment(self, seg: int) -> int:
        """A descriptor to write segment ``seg`` (created if missing; caller holds the write lock)."""
        cur = self._write
        if cur is not None:
            if cur[0] == seg and os.path.exists(self._path(seg)):
                return cur[1]
            os.close(cur[1])
            self._write = None
        if not self.directory.exists():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fsync_dir(self.directory.parent)
        fd = os.open(self._path(seg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size == 0:
            # A new segment's directory entry must survive a crash before any row points into it.
            fsync_dir(self.directory)
        self._write = (seg, fd)
        return fd

    def _start(self) -> tuple[int, int]:
        """Where appends continue when the database has no position yet (a new log, or one written before
        migration 7, which never zero-filled ahead): the end of the newest segment."""
        segs = self.segments()
        if not segs:
            return 0, 0
        return segs[-1], os.stat(self._path(segs[-1])).st_size

    def _reader(self, seg: int) -> int:
        with self._mu:
            fd = self._readers.get(seg)
            if fd is None:
                try:
                    fd = os.open(self._path(seg), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise BlobGone(f"blob log segment {seg} is gone") from None
                self._readers[seg] = fd
            return fd

    # -- the operations ---------------------------------------------------------------------------

    def append(self, values: Sequence[bytes], position: tuple[int, int] | None) -> tuple[list[bytes], tuple[int, int]]:
        """Write ``values`` at ``position`` (the log's end as the database records it, or None if it has
        none yet) and make them durable. Returns one locator per value and the new end.

        The caller must hold the tenant database's write lock (be inside its write transaction) and record
        the new end in that transaction, which then commits the rows referring to the locators.
        """
        seg, end = position if position is not None else self._start()
        if not values:
            return [], (seg, end)
        need = sum(_HEADER.size + len(v) for v in values)
        if end > 0 and end + need > self._segment_max:
            seg, end = seg + 1, 0
        fd = self._open_segment(seg)
        start = end
        bufs: list[bytes] = []
        locs: list[bytes] = []
        for v in values:
            rid = int.from_bytes(os.urandom(8), "little")
            bufs.append(_HEADER.pack(_MAGIC, len(v), rid))
            bufs.append(v)
            locs.append(LOCATOR.pack(seg, end, len(v), rid))
            end += _HEADER.size + len(v)
        pos = start
        for i in range(0, len(bufs), _IOV_MAX):
            chunk = bufs[i: i + _IOV_MAX]
            want = sum(len(b) for b in chunk)
            wrote = os.pwritev(fd, chunk, pos)
            if wrote != want:  # a short write on a regular file means the disk is full
                os.ftruncate(fd, start)
                raise OSError(errno.ENOSPC, f"short write to the blob log ({wrote} of {want} bytes)")
            pos += wrote
        # Keep zero-filled space ahead of the end for the next appends (at least two more batches like
        # this one, filled for eight at a time), so they write over allocated blocks. It goes out with
        # this fdatasync: one journal commit per refill instead of one per append. Not for large batches
        # (``_ZERO_FILL_MAX``): writing their size again in zeros costs more than the journal commit.
        size = os.fstat(fd).st_size
        if need < _ZERO_FILL_MAX and size < end + max(_PREFILL // 4, 2 * need):
            target = min(max(end + max(_PREFILL, 8 * need), size), max(self._segment_max, end))
            at = max(size, end)
            while at < target:
                n = os.pwrite(fd, _ZEROS[: min(len(_ZEROS), target - at)], at)
                at += n
        os.fdatasync(fd)
        self._drop_cached(fd, seg, end)
        return locs, (seg, end)

    def _drop_cached(self, fd: int, seg: int, end: int) -> None:
        """Drop durable bytes of segment ``seg`` older than the newest ``cache_keep`` from the page cache.

        In whole ``_DROP_ALIGN`` chunks: the cache holds a file in naturally aligned folios of up to 2 MiB,
        and one that straddles the range's edge would stay."""
        upto = (end - self._cache_keep) // _DROP_ALIGN * _DROP_ALIGN
        done = self._uncached[1] if self._uncached[0] == seg else 0
        if upto <= done or not hasattr(os, "posix_fadvise"):
            return
        os.posix_fadvise(fd, done, upto - done, os.POSIX_FADV_DONTNEED)
        self._uncached = (seg, upto)

    def read(self, loc: bytes) -> bytes:
        seg, off, length, rid = LOCATOR.unpack(bytes(loc))
        data = os.pread(self._reader(seg), _HEADER.size + length, off)
        if len(data) != _HEADER.size + length or _HEADER.unpack_from(data) != (_MAGIC, length, rid):
            raise BlobGone(f"blob log record at segment {seg} offset {off} is not there")
        return data[_HEADER.size:]

    def release(self, locs: Iterable[bytes]) -> int:
        """Punch the records of deleted rows out of their segments (call after the delete committed).
        Returns the bytes freed."""
        by_seg: dict[int, list[tuple[int, int]]] = {}
        for loc in locs:
            seg, off, length, _ = LOCATOR.unpack(bytes(loc))
            by_seg.setdefault(seg, []).append((off, _HEADER.size + length))
        freed = 0
        for seg, ranges in by_seg.items():
            try:
                fd = os.open(self._path(seg), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                for off, length in ranges:
                    _punch(fd, off, length)
                    freed += length
                os.fdatasync(fd)
            finally:
                os.close(fd)
        return freed

    def vacuum(self, live: Iterable[bytes], position: tuple[int, int] | None,
               locked: Callable[[], ContextManager[Any]] | None = None) -> tuple[int, int]:
        """Reclaim everything no live locator points at: unlink segments with nothing live (except the one
        appends continue into) and punch the gaps of the others, below the log's end in its current
        segment (the zero-filled space after it is kept for the next appends). Returns (segments removed,
        bytes punched).

        ``live`` and ``position`` are every locator the tenant's rows hold and the recorded end, read in one
        snapshot. Rows only ever refer to records below the recorded end, and appends only ever go at or
        above it, so a range no row of a snapshot refers to, below that snapshot's end, stays garbage for
        good: with ``locked`` (a context manager taking the tenant's write lock) only unlinking a segment
        happens under it, and writers go on while the rest runs. Without it the caller holds the lock."""
        cur_seg, cur_end = position if position is not None else self._start()
        by_seg: dict[int, list[tuple[int, int]]] = {}
        for loc in live:
            seg, off, length, _ = LOCATOR.unpack(bytes(loc))
            by_seg.setdefault(seg, []).append((off, off + _HEADER.size + length))
        segs = self.segments()
        removed = punched = 0
        for seg in segs:
            if seg > cur_seg:
                continue  # written by a transaction that never committed: the next appends reuse it
            ranges = sorted(by_seg.get(seg, ()))
            if not ranges and seg != cur_seg:
                if locked is None:
                    self._drop_segment(seg)
                else:
                    with locked():  # no append in flight while its descriptor may be closed
                        self._drop_segment(seg)
                removed += 1
                continue
            fd = os.open(self._path(seg), os.O_RDWR | os.O_CLOEXEC)
            try:
                size = cur_end if seg == cur_seg else os.fstat(fd).st_size
                pos = 0
                for lo, hi in ranges + [(size, size)]:
                    if lo > pos:
                        punched += self._punch_data(fd, pos, lo)
                    pos = max(pos, hi)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        return removed, punched

    @staticmethod
    def _punch_data(fd: int, lo: int, hi: int) -> int:
        """Punch [lo, hi), skipping what is already a hole; returns the bytes that held data."""
        n = 0
        pos = lo
        while pos < hi:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only holes from here to the end of the file
                    break
                raise
            if data >= hi:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), hi)
            # A block shared with a live record stays allocated with its dead part zeroed: do not count
            # (or rewrite) such an edge again once it is all zeros.
            if hole - data > _EDGE or any(os.pread(fd, hole - data, data)):
                _punch(fd, data, hole - data)
                n += hole - data
            pos = hole
        return n

    def _drop_segment(self, seg: int) -> None:
        """Free and unlink a segment with nothing live (caller holds the write lock, so no append is in
        flight and the write descriptor is not in use). It is truncated first: a reader descriptor still
        open on it (here or in another process) must not keep its blocks allocated. Reader descriptors stay
        open until ``close``: closing one that another thread is reading through could hand its number to
        an unrelated file; segment numbers are never reused."""
        if self._write is not None and self._write[0] == seg:
            os.close(self._write[1])
            self._write = None
        fd = os.open(self._path(seg), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        os.unlink(self._path(seg))

    def close(self) -> None:
        with self._mu:
            fds = list(self._readers.values())
            self._readers.clear()
        if self._write is not None:
            fds.append(self._write[1])
            self._write = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def destroy(self) -> None:
        """Close and remove every segment (the tenant is being dropped)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["BlobGone", "BlobLog", "LOCATOR", "LOGGED", "LOG_TYPE", "live_locators", "load_position", "store_position"]
