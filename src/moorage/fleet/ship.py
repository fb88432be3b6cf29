"""Ships a sleeping sandbox's directory to the object store and back, so any host can wake it.

A shipped snapshot is a manifest (``<prefix>/snapshots/<name>.json``: every directory, symlink and file with its
mode and owner, each file as a list of fixed-size chunks) plus the chunks themselves, stored under the sha256 of
their bytes (``<prefix>/chunks/<sha256>``). A chunk already stored is never sent again, so shipping after a turn
that changed one file sends that file's changed chunks only; all-zero chunks are holes (sparse files stay sparse).
Memory use is one chunk per worker, never a whole file.

A local index (``.ship-index.json`` in the directory) remembers each file's chunks by (inode, size, ctime), so an
unchanged file is not read again; ctime cannot be set from inside a sandbox, so a guest cannot make a changed file
look unchanged.

``prune`` keeps an instance's newest few snapshots (the newest is the one to wake from, the others its fallbacks
should it be damaged) and deletes the older ones with the chunks only they used, and the chunks of shipments that
failed midway (no manifest names them) once they are older than ``ORPHAN_GRACE_S``.

The manifest's format and checks are in ship_format.py, the pull in ship_pull.py, the prune in ship_prune.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from moorage.fleet.ship_format import (
    _BOOT_ID,
    CHUNK_BYTES,
    INDEX_NAME,
    MANIFEST_VERSION,
    ORPHAN_GRACE_S,
    ShipReport,
    SnapshotUnavailable,
    _digest_of,
)
from moorage.fleet.ship_prune import Pruning
from moorage.fleet.ship_pull import Pulling
from moorage.objects import ObjectExists, ObjectNotFound, ObjectStore


class Shipper(Pulling, Pruning):
    """Pushes and pulls sandbox directories under ``prefix`` of ``store`` (one prefix per instance)."""

    def __init__(self, store: ObjectStore, *, chunk_bytes: int = CHUNK_BYTES, workers: int = 4) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.workers = workers
        #: Shared by pushes and pulls (threads started once, not per transfer).
        self._pool = ThreadPoolExecutor(workers * 2, thread_name_prefix="ship")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- keys -----------------------------------------------------------------------------------------

    @staticmethod
    def manifest_key(prefix: str, name: str) -> str:
        return f"{prefix}/snapshots/{name}.json"

    @staticmethod
    def _chunk_key(prefix: str, digest: str) -> str:
        return f"{prefix}/chunks/{digest}"

    # -- push -----------------------------------------------------------------------------------------

    def push(self, src: Path, prefix: str, name: str, *, include: Callable[[str], bool],
             meta: dict[str, Any] | None = None, epoch: int = 0,
             before_publish: Callable[[], None] | None = None) -> ShipReport:
        """Ship ``src`` (quiescent: the sandbox is asleep) as snapshot ``name``; durable when this returns.
        ``before_publish`` is called once the chunks are stored, before the manifest is written: it raises to
        leave the snapshot unpublished (the caller deals with the chunks)."""
        started = time.monotonic()
        src = Path(src)
        index = self._load_index(src)
        old_files: dict[str, Any] = index.get("files", {})
        stored: set[str] = set(index.get("stored", {}).get(prefix, []))
        entries: list[dict[str, Any]] = []
        files: dict[str, Any] = {}
        moved = [0, 0]
        pool = self._pool
        pending = []
        # Hard links stay hard links (a process sandbox's checkpoints link the files they share): the later paths
        # of one file say which earlier one they are (``same_as``), read and stored once.
        inodes: dict[tuple[int, int], str] = {}
        for rel, st in self._walk(src, include):
            entry: dict[str, Any] = {"path": rel, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid}
            if stat.S_ISDIR(st.st_mode):
                entry["type"] = "dir"
            elif stat.S_ISLNK(st.st_mode):
                entry.update(type="link", target=os.readlink(src / rel))
            else:
                entry.update(type="file", size=st.st_size, mtime_ns=st.st_mtime_ns)
                sig = [st.st_ino, st.st_size, st.st_ctime_ns]
                known = old_files.get(rel)
                first = inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
                if first is None and st.st_nlink > 1:
                    inodes[(st.st_dev, st.st_ino)] = rel
                if first is not None:
                    # Its chunks too: a puller of an older version, which knows no ``same_as``, writes a copy.
                    entry["same_as"] = first
                    chunks = files[first]["chunks"]
                elif known is not None and known.get("sig") == sig and all(d is None or d in stored for d in known["chunks"]):
                    chunks = known["chunks"]
                else:
                    chunks = self._chunk_file(src / rel, prefix, stored, pool, pending, moved)
                entry["chunks"] = chunks
                files[rel] = {"sig": sig, "chunks": chunks}
            entries.append(entry)
        for f in pending:
            f.result()  # an upload that failed fails the push: the manifest is never written
        if before_publish is not None:
            before_publish()
        body = {"version": MANIFEST_VERSION, "chunk_bytes": self.chunk_bytes, "created_at": time.time(),
                "meta": meta or {}, "entries": entries}
        key = self.manifest_key(prefix, name)
        self.store.put_bytes(key, json.dumps(body, separators=(",", ":")).encode())
        stored.update(d for e in entries for d in e.get("chunks", []) if d)
        self._save_index(src, {"key": key, "epoch": epoch, "boot": _BOOT_ID, "files": files,
                               "stored": {prefix: sorted(stored)}})
        return ShipReport(key, len(files), sum(e.get("size", 0) for e in entries), moved[0], moved[1],
                          time.monotonic() - started)

    def _chunk_file(self, path: Path, prefix: str, stored: set[str], pool: ThreadPoolExecutor, pending: list,
                    moved: list[int]) -> list[str | None]:
        chunks: list[str | None] = []
        with open(path, "rb") as f:
            while True:
                data = f.read(self.chunk_bytes)
                if not data:
                    break
                digest = _digest_of(data)
                chunks.append(digest)
                if digest is not None and digest not in stored:
                    stored.add(digest)
                    moved[0] += 1
                    moved[1] += len(data)
                    # Bounded: never more chunks in flight than workers (each holds one chunk in memory).
                    while sum(1 for p in pending if not p.done()) >= self.workers:
                        next(p for p in pending if not p.done()).result()
                    pending.append(pool.submit(self._put_chunk, prefix, digest, data))
        return chunks

    def _put_chunk(self, prefix: str, digest: str, data: bytes) -> None:
        key = self._chunk_key(prefix, digest)
        try:
            if self.store.head(key).modified >= time.time() - ORPHAN_GRACE_S / 2:
                return
            # An old chunk that no manifest this directory knows names (perhaps a failed shipment's leftover): written
            # again, same bytes, so that the orphan sweep's grace period covers it until this shipment's manifest.
            self.store.put_bytes(key, data)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectExists):
            self.store.put_bytes(key, data, if_absent=self.store.supports_if_absent)

    @staticmethod
    def _walk(root: Path, include: Callable[[str], bool]) -> list[tuple[str, os.stat_result]]:
        out: list[tuple[str, os.stat_result]] = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            keep = []
            for d in sorted(dirnames):
                rel = d if rel_dir == "." else f"{rel_dir}/{d}"
                st = os.lstat(os.path.join(dirpath, d))
                if not include(rel):
                    continue
                out.append((rel, st))
                if stat.S_ISDIR(st.st_mode):
                    keep.append(d)  # a symlink to a directory is shipped as a link, never followed
            dirnames[:] = keep
            for name in sorted(filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if rel == INDEX_NAME or not include(rel):
                    continue
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    out.append((rel, st))  # sockets, fifos and devices are host-local: never shipped
        return out

    # -- the local index ------------------------------------------------------------------------------

    def local_state(self, d: Path) -> tuple[str | None, int | None]:
        """(the shipped snapshot the directory is exactly, or None once it ran since; the lease epoch under which
        this host last held it, or None when it has no copy)."""
        if not Path(d).is_dir():
            return None, None
        index = self._load_index(d)
        key, epoch = index.get("key"), index.get("epoch")
        if index.get("boot") != _BOOT_ID:
            key = None  # written before a reboot: its pages may not all have reached the disk
        return (key if isinstance(key, str) else None), (epoch if isinstance(epoch, int) else None)

    def mark_running(self, d: Path, epoch: int) -> None:
        """The directory is about to change (its sandbox wakes): it is no longer exactly any shipped snapshot."""
        index = self._load_index(d)
        index.update(key=None, epoch=epoch)
        self._save_index(d, index)

    @staticmethod
    def _load_index(d: Path) -> dict[str, Any]:
        try:
            data = json.loads((Path(d) / INDEX_NAME).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _save_index(d: Path, data: dict[str, Any]) -> None:
        tmp = Path(d) / f"{INDEX_NAME}.tmp"
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, Path(d) / INDEX_NAME)

__all__ = ["CHUNK_BYTES", "INDEX_NAME", "MANIFEST_VERSION", "ORPHAN_GRACE_S", "ShipReport", "Shipper", "SnapshotUnavailable"]
