"""Incremental RAM for micro-VM checkpoints: a checkpoint stores only the guest pages that changed since the
checkpoint before it (its base), and a rollback puts the whole RAM delta back together from that chain.

A checkpoint directory holds, besides its device state and record:

- ``ram.idx``: every page that differs from the template at that point (the set a whole delta would hold);
- ``ram.hash``: a seeded XXH3-128 of each of those pages, in page order;
- ``ram.own`` and ``ram.zst``: the pages stored here (new since the base, or changed), and their bytes as one
  zstd frame (level 1: guest pages compress 4-5x here, at ~300 MB/s; checkpoints from before hold them raw in
  ``ram.delta``, still read);
- ``ram.json``: ``{"id", "base", "base_id", "depth", "seed"}``.

A checkpoint is taken in two steps: ``capture`` reads the pages while the guest is paused (compared and hashed,
the new ones copied raw into the page cache, nothing synced), and ``write`` compresses and syncs them after the
guest runs again, so the pause lasts only as long as reading the guest's changed pages takes. Both stream through
files, as does a rollback's decompression: host memory stays flat whatever the guest holds.

A page in ``ram.idx`` but not in ``ram.own`` hashed the same at the base, so its bytes are the base's (found the
same way there). Pages are compared by content, not by dirty bits (the kernels here have no soft-dirty bits), so
any checkpoint can be a base: the one last taken or rolled back to. Every ``MAX_DEPTH``-th checkpoint is whole, so
a rollback reads at most that many deltas, and every page it assembles is checked against the hash recorded for
it. A checkpoint that retention deletes while a later one still builds on it loses its record (it no longer lists
or restores) and keeps its RAM files until nothing refers to them (``collect``). The seed is random per whole
checkpoint and stays on the host, so the guest cannot choose pages that collide with what the host recorded.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from moorage.sandbox import microvm_ram as ram
from moorage.sandbox.base import SnapshotCorrupt

CHAIN = "ram.json"
#: Checkpoints in a chain, the whole one included: a rollback reads at most this many deltas.
MAX_DEPTH = 8
_HASH = 16
#: zstd level of the stored pages: level 1 keeps most of the ratio (4.6x vs 5.1x at 3 on guest pages) at half the time.
ZSTD_LEVEL = 1
_ZSTD_HEADER_MAX = 18  # the longest zstd frame header: enough to read the content size it declares


def info(cp_dir: Path) -> dict[str, Any] | None:
    """The chain record of a checkpoint directory, or None (a whole checkpoint from before chains)."""
    try:
        return json.loads((cp_dir / CHAIN).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SnapshotCorrupt(f"RAM chain record of {cp_dir} is unreadable: {e}", hint="roll back to another checkpoint") from e


def _hashes(cp_dir: Path) -> tuple[np.ndarray, list[bytes]]:
    pages = _pages(ram.read_runs(cp_dir / "ram.idx"))
    data = (cp_dir / "ram.hash").read_bytes()
    if len(data) != len(pages) * _HASH:
        raise SnapshotCorrupt(f"RAM page hashes of {cp_dir} do not match its index", hint="roll back to another checkpoint")
    return pages, [data[i : i + _HASH] for i in range(0, len(data), _HASH)]


def _pages(runs: list[tuple[int, int]]) -> np.ndarray:
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, a + b, dtype=np.int64) for a, b in runs])


@dataclass
class Capture:
    """The RAM of a paused guest, read for a checkpoint and not yet stored (``write``)."""

    record: dict[str, Any]
    every: list[int]
    own: list[int]
    digests: list[bytes]
    raw: Path  # the ``own`` pages' bytes in page order, unsynced and uncompressed


def capture(pid: int, m: ram.Mapping, template_ram: Path, base: Path | None, out_dir: Path,
            dirty: ram.Dirty | None = None) -> Capture:
    """Read the RAM of a paused guest for a checkpoint (or its pages ``dirty`` copied while it was paused): every
    page that differs from the template, hashed, and the bytes of those that differ from ``base`` (a checkpoint
    directory of the same sandbox, or None for a whole one), written raw to ``out_dir`` (page cache, no sync: a
    file, so host memory stays flat whatever the guest holds)."""
    base_info = info(base) if base is not None else None
    known: dict[int, bytes] = {}
    if base_info is not None and base_info["depth"] + 1 < MAX_DEPTH:
        pages, hashes = _hashes(base)  # type: ignore[arg-type]
        known = dict(zip(pages.tolist(), hashes))
        seed, depth = int(base_info["seed"]), base_info["depth"] + 1
        record = {"id": secrets.token_hex(8), "base": base.name, "base_id": base_info["id"], "depth": depth,  # type: ignore[union-attr]
                  "seed": seed}
    else:
        seed = secrets.randbits(64)
        record = {"id": secrets.token_hex(8), "base": None, "base_id": None, "depth": 0, "seed": seed}
    every: list[int] = []
    own: list[int] = []
    digests: list[bytes] = []
    raw = out_dir / "ram.raw"
    with open(raw, "wb") as data:
        for page, content in ram.changed_pages(pid, m, template_ram, dirty):
            h = xxhash.xxh3_128_digest(content, seed=seed)
            every.append(page)
            digests.append(h)
            if known.get(page) != h:
                data.write(content)
                own.append(page)
    return Capture(record, every, own, digests, raw)


def write(cap: Capture, out_dir: Path) -> dict[str, Any]:
    """Store a capture in the new checkpoint directory ``out_dir`` (synced): its raw pages compressed, streamed.
    Returns the chain record plus ``delta_bytes`` (the pages stored here, uncompressed), ``stored_bytes`` (on disk)
    and ``ram_bytes`` (the whole delta it stands for)."""
    size = len(cap.own) * ram.PAGE
    with open(cap.raw, "rb") as src, open(out_dir / "ram.zst", "wb") as dst:
        _, stored = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).copy_stream(src, dst, size=size)
        dst.flush()
        os.fsync(dst.fileno())
    cap.raw.unlink()
    ram.write_synced(out_dir / "ram.idx", ram.pack_runs(ram.runs_of(cap.every)))
    ram.write_synced(out_dir / "ram.own", ram.pack_runs(ram.runs_of(cap.own)))
    ram.write_synced(out_dir / "ram.hash", b"".join(cap.digests))
    ram.write_synced(out_dir / CHAIN, json.dumps(cap.record).encode())
    return {**cap.record, "delta_bytes": size, "stored_bytes": stored, "ram_bytes": len(cap.every) * ram.PAGE}


def chain(checkpoints: Path, name: str) -> list[Path]:
    """The checkpoint directory ``name`` and the bases it builds on, newest first."""
    out = [checkpoints / name]
    rec = info(out[0])
    while rec is not None and rec["base"] is not None:
        if len(out) >= MAX_DEPTH:
            raise SnapshotCorrupt(f"RAM chain of checkpoint {name} is longer than {MAX_DEPTH}", hint="roll back to another checkpoint")
        d = checkpoints / rec["base"]
        base_rec = info(d) if d.is_dir() else None
        if base_rec is None or base_rec["id"] != rec["base_id"]:
            d = checkpoints / _kept_name(rec["base"], rec["base_id"])  # its name was taken again: kept aside
            base_rec = info(d) if d.is_dir() else None
            if base_rec is None or base_rec["id"] != rec["base_id"]:
                raise SnapshotCorrupt(f"checkpoint {name} builds on RAM of {rec['base']} that is gone", hint="roll back to another checkpoint")
        out.append(d)
        rec = base_rec
    return out


def _kept_name(name: str, chain_id: str) -> str:
    return f".{name}.{chain_id}"


def materialize(checkpoints: Path, name: str, out_dir: Path) -> tuple[int, str]:
    """Write the whole RAM delta of checkpoint ``name`` (``ram.delta`` + ``ram.idx``, what a sleep leaves) into
    ``out_dir``, each page checked against its recorded hash; returns its bytes and its digest
    (``microvm_ram.delta_digest``, what a wake checks it against). Not synced: a rollback that a crash interrupts is taken again from the checkpoint."""
    members = chain(checkpoints, name)
    top = members[0]
    if info(top) is None:  # a whole checkpoint from before chains: already in that form
        for f in ("ram.delta", "ram.idx"):
            shutil.copyfile(top / f, out_dir / f)
        return (out_dir / "ram.delta").stat().st_size, ram.delta_digest(out_dir / "ram.delta")
    pages, hashes = _hashes(top)
    seed = int(info(top)["seed"])  # type: ignore[index]
    # Where each page's bytes are: the newest member that stores it.
    where: dict[int, tuple[int, int]] = {}
    views: list[_Pages] = []
    scratch = out_dir / "ram.members"  # compressed members decompressed here (files: host memory stays flat)
    scratch.mkdir(exist_ok=True)
    try:
        for i, d in enumerate(members):
            own = _pages(ram.read_runs(d / "ram.own"))
            views.append(_stored(d, len(own) * ram.PAGE, scratch / f"{i}.raw"))
            if len(views[-1]) != len(own) * ram.PAGE:
                raise SnapshotCorrupt(f"RAM delta of checkpoint {d.name} does not match its index", hint="roll back to another checkpoint")
            for k, p in enumerate(own.tolist()):
                where.setdefault(p, (i, k * ram.PAGE))
        digest = xxhash.xxh3_128()
        with open(out_dir / "ram.delta", "wb") as out:
            for p, h in zip(pages.tolist(), hashes):
                src = where.get(p)
                content = views[src[0]][src[1] : src[1] + ram.PAGE] if src is not None else b""
                if src is None or xxhash.xxh3_128_digest(content, seed=seed) != h:
                    raise SnapshotCorrupt(f"RAM page {p} of checkpoint {name} is missing or changed", hint="roll back to another checkpoint")
                out.write(content)
                digest.update(content)
    finally:
        for v in views:
            v.close()
        shutil.rmtree(scratch, ignore_errors=True)
    shutil.copyfile(top / "ram.idx", out_dir / "ram.idx")
    return len(pages) * ram.PAGE, digest.hexdigest()


def _stored(cp_dir: Path, size: int, scratch: Path) -> _Pages:
    """The bytes of the pages a checkpoint stores (``size`` by its index): its ``ram.zst`` decompressed
    into the file ``scratch``, or its raw ``ram.delta``. A frame whose header names another size is refused before
    anything is decompressed (and zstd refuses content that differs from its header)."""
    packed = cp_dir / "ram.zst"
    if not packed.exists():
        return _Pages(cp_dir / "ram.delta")
    try:
        with open(packed, "rb") as src:
            if zstandard.frame_content_size(src.read(_ZSTD_HEADER_MAX)) != size:
                raise SnapshotCorrupt(f"RAM pages of checkpoint {cp_dir.name} do not match its index", hint="roll back to another checkpoint")
            src.seek(0)
            with open(scratch, "wb") as dst:
                zstandard.ZstdDecompressor().copy_stream(src, dst)
    except zstandard.ZstdError as e:
        raise SnapshotCorrupt(f"RAM pages of checkpoint {cp_dir.name} do not decompress: {e}", hint="roll back to another checkpoint") from e
    return _Pages(scratch)


class _Pages:
    """A file's bytes, read on demand with ``pread``: through the page cache, never mapped into this process."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, span: slice) -> bytes:
        return os.pread(self._fd, span.stop - span.start, span.start)

    def close(self) -> None:
        os.close(self._fd)


def set_aside(checkpoints: Path, name: str) -> None:
    """Before checkpoint ``name`` is taken again: if later checkpoints build on the one of that name, move it
    aside (unlisted) so they still find their pages; otherwise leave it to be replaced."""
    d = checkpoints / name
    rec = info(d) if d.is_dir() else None
    if rec is None or not any(r is not None and r["base"] == name and r["base_id"] == rec["id"]
                              for r in (_safe_info(o) for o in checkpoints.iterdir() if o.is_dir() and o != d)):
        return
    (d / "snapshot.json").unlink(missing_ok=True)
    os.rename(d, checkpoints / _kept_name(name, rec["id"]))


def _safe_info(d: Path) -> dict[str, Any] | None:
    try:
        return info(d)
    except SnapshotCorrupt:
        return None


def collect(checkpoints: Path) -> list[str]:
    """Remove checkpoint directories that no longer list (their record deleted, or left half-written by a crash)
    and that no listed checkpoint builds on; returns their names."""
    if not checkpoints.is_dir():
        return []
    dirs = [d for d in checkpoints.iterdir() if d.is_dir()]
    needed: set[str] = set()
    for d in dirs:
        if (d / "snapshot.json").exists():
            try:
                needed.update(m.name for m in chain(checkpoints, d.name))
            except SnapshotCorrupt:
                needed.add(d.name)  # it fails its own rollback; what it names is kept as it is
    gone = [d for d in dirs if d.name not in needed]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [d.name for d in gone]
