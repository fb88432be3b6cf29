"""Guest RAM files for the micro-VM driver: whole-file digests, sparse copies, and copy-on-write deltas.

A forked VM maps its template's RAM privately (MAP_PRIVATE; on a root host from a sealed memfd copy of the file,
``microvm_memfd``): pages the guest writes become anonymous pages of the QEMU process. The host finds them in /proc/PID/pagemap and saves only those ("the delta") when the VM
sleeps; waking maps the template again and writes the delta back through /proc/PID/mem before the guest runs.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import xxhash

from moorage.sandbox import microvm_memfd
from moorage.sandbox.base import SandboxError, SnapshotCorrupt

PAGE = os.sysconf("SC_PAGE_SIZE")
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE = 1 << 61  # file-backed or shared-anon: for a private file mapping, "still the template's page"
#: Pages per pagemap read: big sequential reads keep the scan in the ms range (8 bytes a page).
_CHUNK_PAGES = 8192
#: Pages per read or write of guest memory and of delta files: 1 MiB, so the host's memory for copying a guest's
#: pages stays flat however many it holds (32 MiB chunks, read twice to compare, took the host +73 MiB).
_DATA_PAGES = 256
#: A checkpoint copies the guest's private pages in its pause and compares them with the template once the guest
#: runs again, when they take at most this much host memory; more are compared in the pause (memory stays flat).
COPY_MAX_BYTES = 16 << 20
_IDX = struct.Struct("<II")  # (first page, page count) runs
_EXTENT = struct.Struct("<QQ")  # (start, end) of a data extent, hashed before its bytes
_READ_BYTES = 4 << 20


class RamError(SandboxError):
    code = "sandbox-ram"


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int


def find_mapping(pid: int, path: Path) -> Mapping:
    """The address range where QEMU mapped the guest RAM file ``path`` (the biggest mapping of it), or the sealed
    memfd copy of it a fork maps (``microvm_memfd``; by its name, so QEMUs an earlier host process started count)."""
    targets = {str(path)}
    if (name := microvm_memfd.memfd_name(path)) is not None:
        targets.add(f"/memfd:{name}")
    best: Mapping | None = None
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n").removesuffix(" (deleted)") in targets:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                m = Mapping(start, end, int(parts[2], 16))
                if best is None or (m.end - m.start) > (best.end - best.start):
                    best = m
    if best is None:
        raise RamError(f"QEMU (pid {pid}) has not mapped the guest RAM file {path}", hint="the VM was started with another memory backend; destroy and recreate the sandbox")
    return best


def dirty_runs(pid: int, m: Mapping) -> list[tuple[int, int]]:
    """Runs (first page, count) of guest pages that differ from the mapped file: private, anonymous copies."""
    npages = (m.end - m.start) // PAGE
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        buf = bytearray()
        for page in range(0, npages, _CHUNK_PAGES):
            n = min(_CHUNK_PAGES, npages - page)
            buf += os.pread(fd, n * 8, (m.start // PAGE + page) * 8)
    finally:
        os.close(fd)
    entries = np.frombuffer(bytes(buf), dtype="<u8")
    dirty = ((entries & np.uint64(_PM_PRESENT | _PM_SWAPPED)) != 0) & ((entries & np.uint64(_PM_FILE)) == 0)
    edges = np.diff(np.concatenate(([0], dirty.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, ends)]


class _Buffers:
    """The host's buffer for the pages a checkpoint's pause copies (``copy_dirty``), kept from one checkpoint to
    the next: a fresh one (up to ``COPY_MAX_BYTES``) had its pages zeroed and faulted in inside the guest's pause
    each time. One is kept (the largest needed so far); a checkpoint that copies while another's copy is still
    in use gets a fresh one, as before. Thread-safe: pauses run on worker threads, several sandboxes at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: bytearray | None = None

    def take(self, size: int) -> bytearray:
        with self._lock:
            buf, self._kept = self._kept, None
        if buf is None or len(buf) < size:
            buf = bytearray(-(-size // (1 << 20)) << 20)  # whole MiB: a guest's next pause needs a few pages more
        return buf

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if self._kept is None or len(self._kept) < len(buf):
                self._kept = buf


_BUFFERS = _Buffers()


@dataclass
class Dirty:
    """A paused guest's private pages, copied (``copy_dirty``): their runs, and their bytes in run order (a view
    of the host's copy buffer, handed back by ``release``: ``changed_pages`` does once it has compared them)."""

    runs: list[tuple[int, int]]
    data: memoryview
    _buf: bytearray | None = None

    def release(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self.data.release()
            _BUFFERS.give(buf)


def copy_dirty(pid: int, m: Mapping, limit: int = COPY_MAX_BYTES) -> Dirty | None:
    """The private pages of a paused guest, read now (None when they take more than ``limit`` bytes): what
    ``changed_pages`` compares with the template, so that the comparison can wait until the guest runs again."""
    runs = dirty_runs(pid, m)
    total = sum(n for _, n in runs) * PAGE
    if total > limit:
        return None
    buf = _BUFFERS.take(total)
    view = memoryview(buf)[:total]
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        pos = 0
        for first, count in runs:
            size = count * PAGE
            if os.preadv(mem, [view[pos : pos + size]], m.start + first * PAGE) != size:
                raise RamError(f"short read of the guest memory of QEMU {pid}", hint="the VM stopped; wake it again")
            pos += size
    except BaseException:
        view.release()
        _BUFFERS.give(buf)
        raise
    finally:
        os.close(mem)
    return Dirty(runs, view, buf)


def changed_pages(pid: int, m: Mapping, template_ram: Path, dirty: Dirty | None = None) -> Iterator[tuple[int, bytes]]:
    """(page number, bytes) of each guest page that differs from the template, in page order: the private copies
    the guest wrote, less those it wrote back to the template's content; read from the paused guest, or from
    ``dirty`` (copied while it was paused; released once this ends). The template's pages are read from its sealed
    memfd where this process has one (the pages forks map)."""
    runs = dirty.runs if dirty is not None else dirty_runs(pid, m)
    copied = memoryview(dirty.data) if dirty is not None else None  # first: one already compared raises here
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY) if dirty is None else -1
    tpl = microvm_memfd.open_for_reading(template_ram)
    pos = 0
    try:
        for first, count in runs:
            for off in range(0, count, _DATA_PAGES):
                n = min(_DATA_PAGES, count - off)
                start = first + off
                if copied is None:
                    cur = os.pread(mem, n * PAGE, m.start + start * PAGE)
                else:
                    cur = copied[pos : pos + n * PAGE].tobytes()  # one copy, as a read from the guest is
                    pos += n * PAGE
                old = os.pread(tpl, n * PAGE, m.offset + start * PAGE)
                for i in range(n):
                    page = cur[i * PAGE : (i + 1) * PAGE]
                    if page != old[i * PAGE : (i + 1) * PAGE]:
                        yield start + i, page
    finally:
        if mem >= 0:
            os.close(mem)
        os.close(tpl)
        if copied is not None and dirty is not None:
            copied.release()
            dirty.release()  # compared: its buffer serves the next checkpoint's pause


def runs_of(pages: Iterable[int]) -> list[tuple[int, int]]:
    """(first page, count) runs of ascending page numbers."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def pack_runs(runs: Iterable[tuple[int, int]]) -> bytes:
    return b"".join(_IDX.pack(a, b) for a, b in runs)


def read_runs(path: Path) -> list[tuple[int, int]]:
    """The runs of an index file (``ram.idx``); a truncated one is a corrupt snapshot."""
    data = path.read_bytes()
    if len(data) % _IDX.size:
        raise SnapshotCorrupt(f"RAM delta index {path} is truncated", hint="the sandbox cold-boots from its disk")
    return [_IDX.unpack_from(data, i) for i in range(0, len(data), _IDX.size)]


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_delta(pid: int, m: Mapping, template_ram: Path, out_dir: Path) -> int:
    """Write ``ram.delta`` + ``ram.idx`` (pages that differ from the template) into ``out_dir``; returns bytes."""
    kept: list[int] = []
    data_path, idx_path = out_dir / "ram.delta.tmp", out_dir / "ram.idx.tmp"
    with open(data_path, "wb") as data:
        for page, content in changed_pages(pid, m, template_ram):
            data.write(content)
            kept.append(page)
        data.flush()
        os.fsync(data.fileno())
    write_synced(idx_path, pack_runs(runs_of(kept)))
    os.replace(data_path, out_dir / "ram.delta")
    os.replace(idx_path, out_dir / "ram.idx")
    return len(kept) * PAGE


def apply_delta(pid: int, m: Mapping, snap_dir: Path) -> int:
    """Write a saved delta into a paused QEMU's private RAM mapping (copy-on-write); returns bytes written."""
    runs = read_runs(snap_dir / "ram.idx")
    npages = (m.end - m.start) // PAGE
    expected = sum(c for _, c in runs) * PAGE
    data_path = snap_dir / "ram.delta"
    if data_path.stat().st_size != expected:
        raise SnapshotCorrupt(f"RAM delta {data_path} has {data_path.stat().st_size} bytes, index says {expected}", hint="the sandbox cold-boots from its disk")
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        with open(data_path, "rb") as data:
            for first, count in runs:
                if first + count > npages:
                    raise SnapshotCorrupt(f"RAM delta page {first + count} is beyond guest memory ({npages} pages)")
                for off in range(0, count, _DATA_PAGES):
                    n = min(_DATA_PAGES, count - off)
                    buf = data.read(n * PAGE)
                    os.pwrite(mem, buf, m.start + (first + off) * PAGE)
    finally:
        os.close(mem)
    return expected


def read_all(pid: int, m: Mapping, out: Path) -> None:
    """Materialise a running (paused) guest's whole RAM as a sparse file: all-zero pages stay holes."""
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    zero = bytes(PAGE)
    size = m.end - m.start
    try:
        with open(out, "wb") as f:
            f.truncate(size)
            for off in range(0, size, _DATA_PAGES * PAGE):
                buf = os.pread(mem, min(_DATA_PAGES * PAGE, size - off), m.start + off)
                i = 0
                n = len(buf) // PAGE
                while i < n:
                    if buf[i * PAGE : (i + 1) * PAGE] == zero:
                        i += 1
                        continue
                    j = i + 1
                    while j < n and buf[j * PAGE : (j + 1) * PAGE] != zero:
                        j += 1
                    f.seek(off + i * PAGE)
                    f.write(buf[i * PAGE : j * PAGE])
                    i = j
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.close(mem)


def file_digest(path: Path) -> str:
    """Digest of every byte of a (sparse) RAM file: XXH3-128 over its data extents, each with its offset, plus
    the size. Holes read as zeros and stay unread, so this costs what the guest touched, not the RAM size; any
    change anywhere (a byte in a hole included: it becomes data) changes the digest."""
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    h.update(str(size).encode())
    view = memoryview(bytearray(_READ_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in microvm_memfd.data_extents(fd, size):
            h.update(_EXTENT.pack(start, end))
            off = start
            while off < end:
                n = os.preadv(fd, [view[: min(_READ_BYTES, end - off)]], off)
                if n <= 0:
                    break
                h.update(view[:n])
                off += n
    finally:
        os.close(fd)
    return f"xxh3:{size}:{h.hexdigest()}"


def digest_matches(path: Path, recorded: object) -> bool:
    """Does ``path`` still have the digest recorded at sleep? Records from before full digests used a sample."""
    if not isinstance(recorded, str):
        return False
    if recorded.startswith("xxh3:"):
        return file_digest(path) == recorded
    return sampled_checksum(path) == recorded


def sampled_checksum(path: Path, samples: int = 512) -> str:
    """The fingerprint snapshots recorded before ``file_digest`` (size plus CRCs of 512 pages); still verified so
    a sandbox that slept under an older version wakes from its snapshot."""
    size = path.stat().st_size
    crc = zlib.crc32(str(size).encode())
    npages = max(size // PAGE, 1)
    step = max(npages // samples, 1)
    with open(path, "rb") as f:
        for p in range(0, npages, step):
            crc = zlib.crc32(os.pread(f.fileno(), PAGE, p * PAGE), crc)
    return f"{size}:{crc:08x}"


def delta_digest(path: Path) -> str:
    """XXH3-128 of a RAM delta file (a snapshot's integrity check, read at every wake: ~25x faster than SHA-256
    here; the files are the host's, so what it guards against is damage, not a forger)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def delta_matches(path: Path, record: dict) -> bool:
    """Does the RAM delta ``path`` still match its snapshot record (``delta_xxh3``, or ``delta_sha256`` from
    before)?"""
    if "delta_xxh3" in record:
        return delta_digest(path) == record["delta_xxh3"]
    return sha256_file(path) == record.get("delta_sha256")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
