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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moorage.errors import MoorageError
from moorage.fsync import fsync_dir
from moorage.objects import ObjectCorrupt, ObjectExists, ObjectNotFound, ObjectStore
from moorage.objects.retry import READS, get_bytes_again

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


class Shipper:
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
             meta: dict[str, Any] | None = None, epoch: int = 0) -> ShipReport:
        """Ship ``src`` (quiescent: the sandbox is asleep) as snapshot ``name``; durable when this returns."""
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
        body = {"version": MANIFEST_VERSION, "chunk_bytes": self.chunk_bytes, "created_at": time.time(),
                "meta": meta or {}, "entries": entries}
        key = self.manifest_key(prefix, name)
        self.store.put_bytes(key, json.dumps(body, separators=(",", ":")).encode())
        stored.update(d for e in entries for d in e.get("chunks", []) if d)
        self._save_index(src, {"key": key, "epoch": epoch, "boot": _BOOT_ID, "files": files,
                               "stored": {prefix: sorted(stored)}})
        return ShipReport(key, len(files), sum(e.get("size", 0) for e in entries), moved[0], moved[1],
                          time.monotonic() - started)

    # -- prune --------------------------------------------------------------------------------------------

    def prune(self, src: Path, prefix: str, *, keep: int, orphan_grace_s: float = ORPHAN_GRACE_S) -> tuple[int, int]:
        """Delete the snapshots under ``prefix`` but the newest ``keep`` (names sort by epoch, then time), and the
        chunks that only they used; ``src`` is the directory last pushed there. Then delete the chunks no remaining
        manifest names that are older than ``orphan_grace_s`` (what shipments that failed midway left). Returns
        (snapshots, chunks) deleted.

        Blocking, and serialised with pushes to ``prefix`` by the caller. Chunks go before their manifest, so an
        interrupted prune is finished by the next one; a manifest that cannot be read stops it (nothing of a
        snapshot that may still be needed is ever guessed away)."""
        if keep < 1:
            raise ValueError("keep at least the newest snapshot")
        snapshots, chunks = self._drop_old(src, prefix, keep)
        return snapshots, chunks + self._drop_orphans(src, prefix, orphan_grace_s)

    def _drop_old(self, src: Path, prefix: str, keep: int) -> tuple[int, int]:
        names = sorted(o.key for o in self.store.iter(f"{prefix}/snapshots/"))
        if len(names) <= keep:
            return 0, 0
        kept, dropped = names[-keep:], names[:-keep]
        referenced = {d for k in kept for d in _chunks_of(self.read_manifest(k))}
        # This directory's index must not believe in chunks about to go: a later push would skip sending them.
        index = self._load_index(src)
        stored = index.get("stored", {}).get(prefix)
        if isinstance(stored, list):
            index["stored"] = {prefix: sorted(set(stored) & referenced)}
            self._save_index(src, index)
        chunks = 0
        for key in dropped:
            try:
                unused = _chunks_of(self.read_manifest(key)) - referenced
            except SnapshotUnavailable:
                unused = set()  # a damaged old manifest: it goes, its chunks wait for ``delete_prefix``
            for digest in sorted(unused):
                self.store.delete(self._chunk_key(prefix, digest))  # a missing one (an earlier try) is no error
                chunks += 1
            self.store.delete(key)
        return len(dropped), chunks

    def _drop_orphans(self, src: Path, prefix: str, grace_s: float) -> int:
        """Delete the chunks under ``prefix`` that no manifest there names and that are older than ``grace_s``.

        Chunks belong to one instance (its prefix): only its own manifests can name them. Chunks are listed before
        the manifests, so a manifest written meanwhile is read; each candidate is looked at again just before it
        goes (a push that reuses an old leftover writes it again, which makes it young). A manifest that cannot be
        read leaves every chunk where it is."""
        cutoff = time.time() - grace_s
        old = [o.key for o in self.store.iter(f"{prefix}/chunks/") if o.modified < cutoff]
        if not old:
            return 0
        named: set[str] = set()
        for o in self.store.iter(f"{prefix}/snapshots/"):
            try:
                named |= _chunks_of(self.read_manifest(o.key))
            except SnapshotUnavailable:
                return 0  # it may still name some of them: nothing is guessed away
        gone: set[str] = set()
        for key in old:
            digest = key.rsplit("/", 1)[1]
            if digest in named:
                continue
            try:
                if self.store.head(key).modified >= cutoff:
                    continue  # written again since it was listed: a shipment in progress counts on it
            except ObjectNotFound:
                continue
            self.store.delete(key)
            gone.add(digest)
        index = self._load_index(src)
        stored = index.get("stored", {}).get(prefix)
        if gone and isinstance(stored, list):
            index["stored"] = {prefix: sorted(set(stored) - gone)}
            self._save_index(src, index)
        return len(gone)

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

    # -- pull -----------------------------------------------------------------------------------------

    def read_manifest(self, key: str) -> dict[str, Any]:
        try:  # read again when it comes back damaged or cut short: giving it up loses what it holds
            body = json.loads(get_bytes_again(self.store, key, max_bytes=256 << 20))
        except ObjectNotFound as e:
            raise SnapshotUnavailable(f"snapshot {key} is not in the object store",
                                      hint="it was deleted or never shipped; the instance falls back to its last good copy") from e
        except (ObjectCorrupt, ValueError) as e:
            raise SnapshotUnavailable(f"snapshot manifest {key} is damaged: {e}") from e
        if not isinstance(body, dict) or body.get("version") != MANIFEST_VERSION or not isinstance(body.get("entries"), list):
            raise SnapshotUnavailable(f"snapshot manifest {key} has an unknown format")
        return body

    def pull(self, key: str, prefix: str, dest: Path, *, epoch: int = 0) -> ShipReport:
        """Make ``dest`` exactly the shipped snapshot ``key``; files a local copy already has are not fetched.

        Built in a temp directory beside ``dest`` and swapped in with renames: a failure (missing or damaged
        chunk) leaves ``dest`` as it was and raises ``SnapshotUnavailable``."""
        started = time.monotonic()
        body = self.read_manifest(key)
        chunk_bytes = int(body.get("chunk_bytes") or CHUNK_BYTES)
        dest = Path(dest)
        tmp = dest.parent / f".pull-{dest.name}-{uuid.uuid4().hex[:8]}"
        old = self._load_index(dest).get("files", {}) if dest.is_dir() else {}
        files: dict[str, Any] = {}
        moved = [0, 0]
        as_root = os.geteuid() == 0
        links: set[str] = set()
        dir_modes: list[tuple[Path, int]] = []
        fetched = dest.parent / f".chunks-{dest.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(mode=0o700)
            fetched.mkdir(mode=0o700)
            self._prefetch(body["entries"], dest, old, prefix, key, fetched, moved)
            for e in body["entries"]:
                rel = _safe_rel(e.get("path"), key)
                if any("/".join(rel.split("/")[:n]) in links for n in range(1, rel.count("/") + 1)):
                    raise SnapshotUnavailable(f"snapshot manifest {key} puts {rel!r} under a symlink")
                p = tmp / rel
                kind = e.get("type")
                if kind == "dir":
                    p.mkdir(mode=0o700)
                    dir_modes.append((p, int(e["mode"]) & 0o7777))
                elif kind == "link":
                    os.symlink(str(e["target"]), p)
                    links.add(rel)
                elif kind == "file" and e.get("same_as") is not None:
                    first = _safe_rel(e["same_as"], key)
                    if first not in files:
                        raise SnapshotUnavailable(f"snapshot manifest {key} links {rel!r} to {first!r}, no file before it")
                    os.link(tmp / first, p)
                    chunks = files[first]["chunks"]
                    files[rel] = {"sig": None, "chunks": chunks}
                elif kind == "file":
                    chunks = list(e.get("chunks") or [])
                    self._write_file(p, dest / rel, old.get(rel), chunks, int(e["size"]), chunk_bytes, prefix, key, moved,
                                     fetched)
                    os.utime(p, ns=(int(e["mtime_ns"]), int(e["mtime_ns"])))
                    st = os.lstat(p)
                    files[rel] = {"sig": [st.st_ino, st.st_size, st.st_ctime_ns], "chunks": chunks}
                else:
                    raise SnapshotUnavailable(f"snapshot manifest {key} has an entry of unknown type {kind!r}")
                if as_root:
                    os.lchown(p, int(e["uid"]), int(e["gid"]))
                if kind == "file":
                    os.chmod(p, int(e["mode"]) & 0o7777)
            for p, mode in reversed(dir_modes):  # last, deepest first: a read-only folder was still filled
                os.chmod(p, mode)
            self._save_index(tmp, {"files": {}, "stored": {}})
            # Not fsynced: a pulled copy is a cache of the object store. Only a machine crash loses unsynced pages,
            # and the index records the boot it was written in: after a reboot the copy is never taken as clean.
            self._swap(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(fetched, ignore_errors=True)
        # ctime changed with the chmod/chown above: record the final signatures so the next push reads nothing.
        for rel, rec in files.items():
            st = os.lstat(dest / rel)
            rec["sig"] = [st.st_ino, st.st_size, st.st_ctime_ns]
        stored = sorted({d for rec in files.values() for d in rec["chunks"] if d})
        self._save_index(dest, {"key": key, "epoch": epoch, "boot": _BOOT_ID, "files": files, "stored": {prefix: stored}})
        return ShipReport(key, len(files), sum(int(e.get("size", 0)) for e in body["entries"]), moved[0], moved[1],
                          time.monotonic() - started)

    @staticmethod
    def _reusable(local: Path, known: dict[str, Any] | None) -> bool:
        """Whether the local copy of a file is still what its index says (by signature; bytes are re-hashed)."""
        if known is None:
            return False
        try:
            st = os.lstat(local)
        except OSError:
            return False
        return known.get("sig") == [st.st_ino, st.st_size, st.st_ctime_ns]

    def _prefetch(self, entries: list[dict[str, Any]], dest: Path, old: dict[str, Any], prefix: str, key: str,
                  into: Path, moved: list[int]) -> None:
        """Fetch, in parallel and onto disk (never all in memory), every chunk the local copy cannot supply."""
        need: set[str] = set()
        for e in entries:
            if e.get("type") != "file":
                continue
            rel = _safe_rel(e.get("path"), key)
            known = old.get(rel) if self._reusable(dest / rel, old.get(rel)) else None
            have = known["chunks"] if known else []
            for i, d in enumerate(e.get("chunks") or []):
                if isinstance(d, str) and not (i < len(have) and have[i] == d):
                    need.add(_check_digest(d, key))

        def one(digest: str) -> int:
            data = self._get_chunk(prefix, digest, key)
            (into / digest).write_bytes(data)
            return len(data)

        for n in self._pool.map(one, sorted(need)):
            moved[0] += 1
            moved[1] += n

    def _write_file(self, p: Path, local: Path, known: dict[str, Any] | None, chunks: list[str | None], size: int,
                    chunk_bytes: int, prefix: str, key: str, moved: list[int], fetched: Path) -> None:
        # A chunk the local copy has at the same place (per its index, checked by signature) is copied, not fetched.
        reuse = None
        if self._reusable(local, known):
            with contextlib.suppress(OSError):
                reuse = open(local, "rb")  # noqa: SIM115 - closed below
        try:
            with open(p, "wb") as out:
                for i, digest in enumerate(chunks):
                    if digest is None:
                        continue  # a hole: left unwritten, the final truncate gives the file its size
                    data = None
                    if reuse is not None and i < len(known["chunks"]) and known["chunks"][i] == digest:
                        reuse.seek(i * chunk_bytes)
                        data = reuse.read(chunk_bytes)
                        if hashlib.sha256(data).hexdigest() != digest:
                            data = None
                    if data is None and (fetched / digest).is_file():
                        data = (fetched / digest).read_bytes()  # verified when it was fetched
                    if data is None:  # the local copy changed under us: fetch it after all
                        data = self._get_chunk(prefix, digest, key)
                        moved[0] += 1
                        moved[1] += len(data)
                    out.seek(i * chunk_bytes)
                    out.write(data)
                out.truncate(size)
        finally:
            if reuse is not None:
                reuse.close()

    def _get_chunk(self, prefix: str, digest: str, key: str) -> bytes:
        # A chunk read back damaged or cut short is read again (a few times, bounded) before the snapshot is given
        # up: a wake that gives it up falls back to an older one and loses what this one held.
        try:
            return get_bytes_again(self.store, self._chunk_key(prefix, digest), max_bytes=self.chunk_bytes * 2,
                                   sha256=digest)
        except ObjectNotFound as e:
            raise SnapshotUnavailable(f"snapshot {key} is incomplete: chunk {digest[:12]} is missing",
                                      hint="the instance falls back to its last good copy") from e
        except ObjectCorrupt as e:
            raise SnapshotUnavailable(f"snapshot {key} is damaged: chunk {digest[:12]}, read {READS} times: {e}") from e

    @staticmethod
    def _swap(tmp: Path, dest: Path) -> None:
        if dest.exists():
            aside = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
            os.rename(dest, aside)
            os.rename(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, dest)
        fsync_dir(dest.parent)

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
