"""The object-store conformance suite: local files and S3 (a real SeaweedFS server) must behave identically."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moorage.errors import InvalidInput
from moorage.objects import Blobs, ObjectCorrupt, ObjectExists, ObjectNotFound, ObjectStore, sha256_file

from .conftest import Harness

MiB = 1 << 20


def write_random(path: Path, size: int, seed: int = 0) -> str:
    """Write ``size`` pseudo-random bytes in 1 MiB steps (never the whole file in memory); returns their sha256."""
    h = hashlib.sha256()
    block = hashlib.sha256(f"seed{seed}".encode()).digest() * (MiB // 32)
    with open(path, "wb") as f:
        left, n = size, 0
        while left:
            chunk = (n.to_bytes(8, "big") + block)[: min(MiB, left)]
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
            n += 1
    return h.hexdigest()


class PeakRSS:
    """Samples this process's resident memory while a block runs; ``growth`` is the peak above the start."""

    def __init__(self) -> None:
        self.peak = self.start = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


# -- round trips ------------------------------------------------------------------------------------


def test_small_values_round_trip(object_store: ObjectStore) -> None:
    info = object_store.put_bytes("instances/t1/i1/metadata.json", b'{"state": "sleeping"}')
    assert info.size == 21 and info.sha256 == hashlib.sha256(b'{"state": "sleeping"}').hexdigest()
    assert object_store.get_bytes("instances/t1/i1/metadata.json") == b'{"state": "sleeping"}'
    head = object_store.head("instances/t1/i1/metadata.json")
    assert (head.size, head.sha256) == (21, info.sha256) and head.modified > 0
    assert object_store.exists("instances/t1/i1/metadata.json")
    # Without if_absent a put replaces the object whole.
    object_store.put_bytes("instances/t1/i1/metadata.json", b"{}")
    assert object_store.get_bytes("instances/t1/i1/metadata.json") == b"{}"


def test_streams_round_trip(object_store: ObjectStore) -> None:
    data = os.urandom(3 * MiB + 17)
    info = object_store.put_stream("templates/d1/ram", io.BytesIO(data))
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    out = io.BytesIO()
    got = object_store.get_stream("templates/d1/ram", out)
    assert out.getvalue() == data and got.sha256 == info.sha256


def test_empty_object(object_store: ObjectStore, tmp_path: Path) -> None:
    object_store.put_bytes("e/empty", b"")
    assert object_store.get_bytes("e/empty") == b""
    object_store.get_file("e/empty", tmp_path / "empty")
    assert (tmp_path / "empty").read_bytes() == b""


def test_large_file_streams_with_flat_memory(object_store: ObjectStore, tmp_path: Path) -> None:
    """128 MiB in and out: the process never holds more than a few parts of it (never the whole object)."""
    size = 128 * MiB
    src, dest = tmp_path / "ram", tmp_path / "ram.back"
    digest = write_random(src, size)
    with PeakRSS() as put_mem:
        info = object_store.put_file("instances/t1/i1/snapshots/1/ram", src)
    assert (info.size, info.sha256) == (size, digest)
    with PeakRSS() as get_mem:
        got = object_store.get_file("instances/t1/i1/snapshots/1/ram", dest)
    assert got.sha256 == digest and sha256_file(dest) == digest and dest.stat().st_size == size
    # Both move 1 MiB steps (S3: four 8 MiB parts at a time, each streamed from or to the file).
    assert put_mem.growth < 32 * MiB, f"put grew RSS by {put_mem.growth / MiB:.1f} MiB"
    assert get_mem.growth < 32 * MiB, f"get grew RSS by {get_mem.growth / MiB:.1f} MiB"


@pytest.mark.parametrize("size", [1, 8 * MiB - 1, 8 * MiB, 8 * MiB + 1, 17 * MiB + 5])
def test_sizes_around_part_boundaries(object_store: ObjectStore, tmp_path: Path, size: int) -> None:
    """Single-request and multipart paths (S3 parts are 8 MiB): every size comes back byte for byte."""
    src = tmp_path / "src"
    digest = write_random(src, size, seed=size)
    assert object_store.put_file("images/rootfs", src).sha256 == digest
    object_store.get_file("images/rootfs", tmp_path / "back")
    assert sha256_file(tmp_path / "back") == digest
    out = io.BytesIO()
    object_store.get_stream("images/rootfs", out)
    assert hashlib.sha256(out.getvalue()).hexdigest() == digest


def test_get_file_replaces_dest_atomically_with_private_mode(object_store: ObjectStore, tmp_path: Path) -> None:
    object_store.put_bytes("packages/p", b"new")
    (tmp_path / "out").mkdir()
    dest = tmp_path / "out" / "p"
    dest.write_bytes(b"old")
    os.chmod(dest, 0o644)
    object_store.get_file("packages/p", dest)
    assert dest.read_bytes() == b"new"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert [p.name for p in dest.parent.iterdir()] == ["p"]  # no temp file left behind


# -- damage and absence -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [4096, 20 * MiB])
def test_damaged_object_raises_and_never_hands_over_bytes(harness: Harness, tmp_path: Path, size: int) -> None:
    store = harness.store
    src = tmp_path / "disk"
    write_random(src, size)
    store.put_file("instances/t1/i1/snapshots/2/disk", src)
    harness.corrupt("instances/t1/i1/snapshots/2/disk")

    (tmp_path / "out").mkdir()
    dest = tmp_path / "out" / "restored"
    dest.write_bytes(b"last good copy")
    with pytest.raises(ObjectCorrupt) as e:
        store.get_file("instances/t1/i1/snapshots/2/disk", dest)
    assert "instances/t1/i1/snapshots/2/disk" in str(e.value) and e.value.hint
    assert dest.read_bytes() == b"last good copy"  # the destination is untouched
    assert [p.name for p in dest.parent.iterdir()] == ["restored"]  # no temp file left behind
    with pytest.raises(ObjectCorrupt):
        store.get_stream("instances/t1/i1/snapshots/2/disk", io.BytesIO())
    if size <= MiB:
        with pytest.raises(ObjectCorrupt):
            store.get_bytes("instances/t1/i1/snapshots/2/disk")


_WRITER = """
import os, sys
from pathlib import Path
from moorage.config import load
from moorage.objects import open_object_store
open_object_store(load(env=os.environ)).put_file(sys.argv[1], Path(sys.argv[2]))
"""


def test_a_writer_killed_mid_put_leaves_the_old_object_whole(harness: Harness, tmp_path: Path) -> None:
    """SIGKILL a process halfway through replacing an object: readers see the old one, whole, and nothing else."""
    key = "instances/t1/i1/snapshots/latest/disk"
    harness.store.put_bytes(key, b"the previous snapshot")
    src = tmp_path / "disk"
    digest = write_random(src, 128 * MiB)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, key, str(src)], cwd=tmp_path,
                              env={**os.environ, "MOORAGE_DATA_DIR": str(tmp_path / "writer"), **harness.env})
    try:
        deadline = time.monotonic() + 300
        while not harness.in_progress(key):
            assert writer.poll() is None, "the writer ended before it could be killed halfway"
            assert time.monotonic() < deadline, "the writer never started to write"
            time.sleep(0.002)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -9
    assert harness.store.get_bytes(key) == b"the previous snapshot"
    assert [o.key for o in harness.store.iter("")] == [key]
    # What the dead writer left is swept (by age; a live writer's recent parts are spared).
    assert harness.leftovers()
    assert harness.store.sweep_incomplete(older_than_s=3600) == 0 and harness.leftovers()
    assert harness.store.sweep_incomplete(older_than_s=0) >= 1
    assert not harness.leftovers()
    with harness.open_another() as restarted:  # the host comes back and stores the snapshot again
        restarted.put_file(key, src)
    (tmp_path / "out").mkdir()
    assert harness.store.get_file(key, tmp_path / "out" / "disk").sha256 == digest


def test_missing_object_is_typed(object_store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        object_store.head("nothing/here")
    with pytest.raises(ObjectNotFound):
        object_store.get_file("nothing/here", tmp_path / "x")
    with pytest.raises(ObjectNotFound):
        object_store.get_stream("nothing/here", io.BytesIO())
    with pytest.raises(ObjectNotFound) as e:
        object_store.get_bytes("nothing/here")
    assert e.value.http_status == 404 and "nothing/here" in str(e.value)
    assert not object_store.exists("nothing/here")
    assert not (tmp_path / "x").exists()
    object_store.delete("nothing/here")  # deleting what is not there is not an error


def test_a_wrong_digest_from_the_caller_never_yields_wrong_bytes(object_store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"actual bytes")
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    try:
        object_store.put_file("k/f", src, sha256=wrong)
    except InvalidInput:
        assert not object_store.exists("k/f")  # refused up front (local files check while copying)
        return
    with pytest.raises(ObjectCorrupt):  # or stored, and every read refuses it
        object_store.get_file("k/f", tmp_path / "back")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../x", "a/../b", ".hidden", "a/.tmp/x", "sp ace", "a/", "x" * 1100])
def test_invalid_keys_are_refused(object_store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidInput):
        object_store.put_bytes(key, b"x")
    with pytest.raises(InvalidInput):
        object_store.head(key)


# -- listing and deleting ---------------------------------------------------------------------------


def test_list_by_prefix_with_pagination(object_store: ObjectStore) -> None:
    keys = [f"instances/t1/i{n:02d}/meta" for n in range(23)]
    others = ["instances/t10/i1/meta", "instances/t1-old/meta", "instances/t2/i1/meta", "packages/p1"]
    for k in keys + others:
        object_store.put_bytes(k, k.encode())

    seen, after, pages = [], None, 0
    while True:
        page = object_store.list("instances/t1/", after=after, limit=5)
        pages += 1
        assert len(page.objects) <= 5
        seen += [o.key for o in page.objects]
        if page.next_token is None:
            break
        after = page.next_token
    assert seen == keys and pages == 5
    sizes = {o.key: o.size for o in object_store.iter("instances/t1/")}
    assert sizes == {k: len(k) for k in keys}
    # A prefix is a plain string prefix, like S3's. Where a segment ends and a sibling goes on with '-' or '.',
    # the order is the backend's (AWS: bytes, 't1-old' first; SeaweedFS: folder by folder, 't1/' first).
    under_t1 = [o.key for o in object_store.iter("instances/t1")]
    assert sorted(under_t1) == sorted(keys + others[:2]) and len(set(under_t1)) == len(under_t1)
    everything = [o.key for o in object_store.list("", limit=1000).objects]
    assert sorted(everything) == sorted(keys + others) and len(set(everything)) == len(everything)
    assert object_store.list("nothing/").objects == [] and object_store.list("nothing/").next_token is None
    with pytest.raises(InvalidInput):
        object_store.list("instances/", limit=0)


def test_delete_and_delete_by_prefix(object_store: ObjectStore) -> None:
    for n in range(12):
        object_store.put_bytes(f"instances/t1/i1/snapshots/{n}/ram", b"r")
    object_store.put_bytes("instances/t1/i2/snapshots/0/ram", b"keep")
    object_store.put_bytes("instances/t1/i10/meta", b"keep")

    object_store.delete("instances/t1/i1/snapshots/0/ram")
    assert not object_store.exists("instances/t1/i1/snapshots/0/ram")
    assert object_store.delete_prefix("instances/t1/i1/") == 11
    assert [o.key for o in object_store.iter("instances/")] == ["instances/t1/i10/meta", "instances/t1/i2/snapshots/0/ram"]
    assert object_store.delete_prefix("instances/t1/i1/") == 0
    with pytest.raises(InvalidInput):
        object_store.delete_prefix("")
    # Keys under a deleted prefix can be written again.
    object_store.put_bytes("instances/t1/i1/snapshots/0/ram", b"again")
    assert object_store.get_bytes("instances/t1/i1/snapshots/0/ram") == b"again"


# -- concurrency and if-absent ----------------------------------------------------------------------


def test_if_absent_semantics(object_store: ObjectStore, tmp_path: Path) -> None:
    assert object_store.supports_if_absent
    object_store.put_bytes("leases/i1", b"first", if_absent=True)
    with pytest.raises(ObjectExists) as e:
        object_store.put_bytes("leases/i1", b"second", if_absent=True)
    assert e.value.http_status == 409
    src = tmp_path / "big"
    write_random(src, 9 * MiB)  # the multipart path checks too
    with pytest.raises(ObjectExists):
        object_store.put_file("leases/i1", src, if_absent=True)
    assert object_store.get_bytes("leases/i1") == b"first"
    object_store.delete("leases/i1")
    object_store.put_file("leases/i1", src, if_absent=True)
    assert object_store.head("leases/i1").size == 9 * MiB


def test_concurrent_if_absent_has_exactly_one_winner(harness: Harness) -> None:
    stores = [harness.store, harness.open_another()]  # two hosts
    try:
        def attempt(n: int) -> int | None:
            try:
                stores[n % 2].put_bytes("claims/i1", f"writer {n}".encode(), if_absent=True)
                return n
            except ObjectExists:
                return None

        with ThreadPoolExecutor(8) as pool:
            winners = [w for w in pool.map(attempt, range(16)) if w is not None]
        assert len(winners) == 1
        assert harness.store.get_bytes("claims/i1") == f"writer {winners[0]}".encode()
    finally:
        stores[1].close()


def test_concurrent_put_of_the_same_blob_is_safe(harness: Harness, tmp_path: Path) -> None:
    src = tmp_path / "pkg.tar.gz"
    digest = write_random(src, 9 * MiB + 3)
    other = harness.open_another()  # a second host putting the same package at the same time
    try:
        blobs = [Blobs(harness.store, "packages", suffix=".tar.gz"), Blobs(other, "packages", suffix=".tar.gz")]
        with ThreadPoolExecutor(6) as pool:
            digests = list(pool.map(lambda n: blobs[n % 2].put_blob(src), range(6)))
        assert digests == [digest] * 6
        assert [o.key for o in harness.store.iter("packages/")] == [f"packages/{digest}.tar.gz"]
        blobs[1].get_blob(digest, tmp_path / "back")
        assert sha256_file(tmp_path / "back") == digest
        assert blobs[0].put_blob(src) == digest  # already there: nothing sent, same answer
    finally:
        other.close()


def test_puts_racing_a_delete_of_their_prefix_never_fail(object_store: ObjectStore) -> None:
    """A delete of a prefix (retention) and puts under it at once: each put either stays or was deleted whole."""
    stop = threading.Event()

    def deleter() -> int:
        n = 0
        while not stop.is_set():
            n += object_store.delete_prefix("instances/t1/i1/")
        return n

    with ThreadPoolExecutor(1) as pool:
        deleted = pool.submit(deleter)
        try:
            for n in range(60):
                object_store.put_bytes(f"instances/t1/i1/snapshots/{n % 4}/meta", f"{n}".encode())
        finally:
            stop.set()
        deleted.result()
    for o in object_store.iter("instances/t1/i1/"):
        assert object_store.get_bytes(o.key).isdigit()


def test_blob_whose_bytes_do_not_match_its_key_is_refused(object_store: ObjectStore, tmp_path: Path) -> None:
    blobs = Blobs(object_store)
    digest = hashlib.sha256(b"what the key promises").hexdigest()
    object_store.put_bytes(blobs.key(digest), b"something else")  # consistent with itself, not with its key
    with pytest.raises(ObjectCorrupt):
        blobs.get_blob(digest, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(ObjectNotFound):
        blobs.get_blob(hashlib.sha256(b"never stored").hexdigest(), tmp_path / "b")
