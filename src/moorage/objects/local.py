"""The local-files object store (the embedded default): one plain file per object under a root directory.

A write goes to a temp file that is fsynced, tagged with its sha256 (extended attribute) and renamed into place,
so data and digest appear together or not at all; directories are 0700 and files 0600.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from moorage.errors import InvalidInput
from moorage.fsync import fsync_dir
from moorage.objects.errors import ObjectCorrupt, ObjectExists, ObjectNotFound, ObjectStoreConfigError
from moorage.objects.keys import check_digest, check_key, check_prefix, copy_hashing
from moorage.objects.store import ObjectInfo, ObjectPage, ObjectStore, check_delete_prefix, check_limit

#: Extended attribute holding an object's sha256 (hex); set on the temp file before the rename publishes it.
XATTR = "user.moorage.sha256"
#: Temp files older than this are left-overs of a writer that died; opening a store removes them.
_STALE_TMP_S = 24 * 3600


class LocalObjectStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()
        self._tmp = self.root / ".tmp"  # keys never start with '.', so this never collides with an object
        try:
            for d in (self.root, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
                os.chmod(d, 0o700)
        except OSError as e:
            raise ObjectStoreConfigError(f"cannot use {self.root} as an object store: {e.strerror}",
                                         hint="choose a writable directory for MOORAGE_OBJECT_STORE_URL") from e
        self._probe_xattr()
        self.sweep_incomplete(_STALE_TMP_S)

    def _probe_xattr(self) -> None:
        fd, name = tempfile.mkstemp(prefix="probe-", dir=self._tmp)
        try:
            os.setxattr(fd, XATTR, b"probe")
        except OSError as e:
            raise ObjectStoreConfigError(
                f"{self.root} is on a filesystem without user extended attributes ({e.strerror})",
                hint="put the object store on ext4, xfs or btrfs, or use an s3:// object store") from e
        finally:
            os.close(fd)
            os.unlink(name)

    def sweep_incomplete(self, older_than_s: float = _STALE_TMP_S) -> int:
        cutoff = time.time() - older_than_s
        n = 0
        for entry in os.scandir(self._tmp):
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                    os.unlink(entry.path)
                    n += 1
        return n

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    # -- writing --------------------------------------------------------------------------------------

    def put_file(self, key: str, path: Path, *, if_absent: bool = False, sha256: str | None = None) -> ObjectInfo:
        check_key(key)
        if sha256 is not None:
            check_digest(sha256)
        with open(path, "rb") as src:
            return self._put(key, src, if_absent, sha256, what=str(path))

    def put_stream(self, key: str, stream: BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        check_key(key)
        return self._put(key, stream, if_absent, None, what="the stream")

    def _put(self, key: str, src: BinaryIO, if_absent: bool, sha256: str | None, *, what: str) -> ObjectInfo:
        fd, tmp = tempfile.mkstemp(prefix="put-", dir=self._tmp)
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size = copy_hashing(src, out)
                if sha256 is not None and digest != sha256:
                    raise InvalidInput(f"{what} has sha256 {digest}, not the {sha256} given",
                                       hint="the file changed while it was stored, or the digest is wrong; nothing was stored")
                os.setxattr(out.fileno(), XATTR, digest.encode())
                out.flush()
                os.fsync(out.fileno())
                modified = os.fstat(out.fileno()).st_mtime
            self._publish(key, tmp, if_absent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return ObjectInfo(key, size, digest, modified)

    def _publish(self, key: str, tmp: str, if_absent: bool) -> None:
        final = self._path(key)
        for _ in range(10):  # a concurrent delete may prune the parent directory between mkdir and rename
            try:
                self._mkdirs(final.parent)
                if if_absent:
                    os.link(tmp, final)  # fails if anything is there: the first writer wins
                else:
                    os.replace(tmp, final)
                break
            except FileNotFoundError:
                continue
            except FileExistsError:
                if if_absent and final.is_file():
                    raise ObjectExists(key) from None
                raise self._collision(key) from None
            except (NotADirectoryError, IsADirectoryError):
                raise self._collision(key) from None
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise self._collision(key) from None
                raise
        else:
            raise InvalidInput(f"could not store {key!r}: its directory kept disappearing",
                               hint="a delete of the same prefix is running; retry")
        with contextlib.suppress(FileNotFoundError):  # a delete of the prefix took the object (and its folder) since
            fsync_dir(final.parent)

    def _mkdirs(self, d: Path) -> None:
        # Path.mkdir(parents=True) creates the parents with the umask's mode; every level here is 0700.
        rel = d.relative_to(self.root)
        cur = self.root
        for part in rel.parts:
            cur = cur / part
            try:
                os.mkdir(cur, 0o700)
            except FileExistsError:
                try:
                    is_dir = stat.S_ISDIR(os.lstat(cur).st_mode)
                except FileNotFoundError:  # a concurrent delete pruned it just now: the caller retries
                    raise FileNotFoundError(errno.ENOENT, "pruned while being created", str(cur)) from None
                if not is_dir:
                    raise

    @staticmethod
    def _collision(key: str) -> InvalidInput:
        return InvalidInput(f"object key {key!r} collides with another key used as its folder (or the reverse)",
                            hint="a key must not also be the beginning 'folder/' of another key")

    # -- reading --------------------------------------------------------------------------------------

    def _open(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key, where=self.url) from None
        return f

    def _recorded(self, f: BinaryIO, key: str) -> str:
        # Read from the open descriptor: the digest belongs to the very inode whose bytes are read.
        try:
            return os.getxattr(f.fileno(), XATTR).decode()
        except OSError as e:
            if e.errno == errno.ENODATA:
                raise ObjectCorrupt(key, "no sha256 was recorded with it") from None
            raise

    def get_file(self, key: str, dest: Path, *, sha256: str | None = None) -> ObjectInfo:
        dest = Path(dest)
        with self._open(key) as src:
            recorded = self._recorded(src, key)
            if sha256 is not None and recorded != sha256:
                raise ObjectCorrupt(key, f"it records sha256 {recorded}, {sha256} was expected")
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    digest, size = copy_hashing(src, out)
                    if digest != recorded:
                        raise ObjectCorrupt(key, f"its bytes hash to {digest}, {recorded} was recorded")
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, dest)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(dest.parent)
            return ObjectInfo(key, size, recorded, os.fstat(src.fileno()).st_mtime)

    def get_stream(self, key: str, out: BinaryIO) -> ObjectInfo:
        with self._open(key) as src:
            recorded = self._recorded(src, key)
            digest, size = copy_hashing(src, out)
            if digest != recorded:
                raise ObjectCorrupt(key, f"its bytes hash to {digest}, {recorded} was recorded")
            return ObjectInfo(key, size, recorded, os.fstat(src.fileno()).st_mtime)

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key, where=self.url) from None
        if not os.path.isfile(path):
            raise ObjectNotFound(key, where=self.url)
        try:
            recorded: str | None = os.getxattr(path, XATTR).decode()
        except OSError:
            recorded = None
        return ObjectInfo(key, st.st_size, recorded, st.st_mtime)

    # -- listing and deleting -------------------------------------------------------------------------

    def _keys_under(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix.rpartition("/")[0]
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    yield key

    def list(self, prefix: str = "", *, after: str | None = None, limit: int = 1000) -> ObjectPage:
        check_prefix(prefix)
        check_limit(limit)
        # S3 orders keys by their bytes, which a directory walk does not ('a-b' < 'a/c'): collect, then sort.
        keys = sorted(self._keys_under(prefix))
        if after is not None:
            keys = keys[bisect.bisect_right(keys, after):]
        objects: list[ObjectInfo] = []
        taken = 0
        for key in keys:
            if len(objects) == limit:
                break
            taken += 1
            with contextlib.suppress(FileNotFoundError):  # deleted since the walk
                st = os.stat(self.root / key)
                objects.append(ObjectInfo(key, st.st_size, None, st.st_mtime))
        more = taken < len(keys)
        return ObjectPage(objects, objects[-1].key if more and objects else None)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        self._prune(path.parent)

    def _prune(self, d: Path) -> None:
        """Remove directories left empty, up to the root (a concurrent put re-creates what it needs)."""
        while d != self.root and self.root in d.parents:
            try:
                os.rmdir(d)
            except OSError:
                return
            d = d.parent

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(check_delete_prefix(prefix))
        n = 0
        for key in sorted(self._keys_under(prefix)):
            try:
                os.unlink(self.root / key)
                n += 1
            except FileNotFoundError:
                continue
            self._prune((self.root / key).parent)
        return n
