"""Pulling a shipped snapshot: read its manifest, fetch in parallel the chunks the local copy cannot supply, build the
directory beside the old one and swap it in, so a missing or damaged chunk leaves the local copy as it was."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from moorage.fleet.ship_format import (
    _BOOT_ID,
    CHUNK_BYTES,
    MANIFEST_VERSION,
    ShipReport,
    SnapshotUnavailable,
    _check_digest,
    _safe_rel,
)
from moorage.fsync import fsync_dir
from moorage.objects import ObjectCorrupt, ObjectNotFound, ObjectStore
from moorage.objects.retry import READS, get_bytes_again


class Pulling:
    """The pull of ``Shipper`` (a mixin: the shipper holds the store, its pool and the local index)."""

    store: ObjectStore
    chunk_bytes: int
    _pool: ThreadPoolExecutor
    _chunk_key: Callable[[str, str], str]
    _load_index: Callable[[Path], dict[str, Any]]
    _save_index: Callable[[Path, dict[str, Any]], None]

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
