"""The SQLite blob log: large LangGraph values written once, outside the tenant's database file.

Unit tests of ``BlobLog`` (append, read, punch, vacuum, segments, a second opener), then the saver on a
real SQLite store: where the bytes land, that deletes and forgetting remove them from the files, copies
stay independent, orphans of failed or killed writers are reclaimed, and a writer killed with SIGKILL
never loses an acknowledged checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from langgraph.checkpoint.base import empty_checkpoint

from moorage.config import Config
from moorage.errors import UnavailableError
from moorage.store import Store, TenantStore, open_store
from moorage.store.bloblog import LOCATOR, BlobGone, BlobLog
from moorage.store.langgraph import MoorageSaver
from moorage.store.sqlite import SQLiteBackend
from tests.store.scan import files_containing
from tests.store.workers import lg_value

WORKERS = Path(__file__).with_name("workers.py")
ROOT = Path(__file__).resolve().parents[2]
BIG = 64 * 1024


def _files_with(root: Path, needle: bytes) -> list[str]:
    return sorted(p.name for p in files_containing(root, needle))


def _allocated(path: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in path.glob("*.seg"))


# -- BlobLog itself --------------------------------------------------------------------------------
# The database records the log's end; here a variable plays that part.


def test_append_read_and_release(tmp_path: Path) -> None:
    log = BlobLog(tmp_path / "t.lg")
    values = [os.urandom(n) for n in (0, 1, 5000, 300_000)]
    locs, pos = log.append(values, None)
    assert [len(x) for x in locs] == [LOCATOR.size] * 4
    assert [log.read(x) for x in locs] == values
    # Space ahead of the end is zero-filled (written), so the next appends need no allocation.
    seg_file = tmp_path / "t.lg" / "00000000.seg"
    assert seg_file.stat().st_size > pos[1] + 1_000_000
    before = _allocated(tmp_path / "t.lg")
    assert log.release([locs[3]]) > 300_000
    # The punched record reads back as zeros: the header check refuses it instead of returning garbage.
    with pytest.raises(BlobGone):
        log.read(locs[3])
    assert log.read(locs[2]) == values[2]
    assert _allocated(tmp_path / "t.lg") <= before - 290_000
    log.close()


def test_large_batches_do_not_refill_zeroed_space(tmp_path: Path) -> None:
    # A batch of 2 MiB or more writes over what zero-filled space there is and grows the file past it,
    # without writing as many zeros again; a small batch after it refills.
    log = BlobLog(tmp_path / "t.lg")
    big = [os.urandom(1 << 20) for _ in range(6)]
    locs, pos = log.append(big, None)
    seg_file = tmp_path / "t.lg" / "00000000.seg"
    assert seg_file.stat().st_size == pos[1]
    (small,), pos = log.append([b"s" * 1000], pos)
    assert seg_file.stat().st_size > pos[1] + 1_000_000
    assert [log.read(x) for x in locs] == big and log.read(small) == b"s" * 1000
    log.close()


def test_appends_continue_at_the_recorded_end(tmp_path: Path) -> None:
    # Two BlobLog objects on one directory stand for two processes (each under the database's write lock);
    # an append whose transaction rolled back is written over, because the recorded end did not move.
    a, b = BlobLog(tmp_path / "t.lg"), BlobLog(tmp_path / "t.lg")
    la, pos = a.append([b"first" * 100], None)
    lost, _ = b.append([b"rolled back" * 100], pos)
    lb, pos = b.append([b"second" * 100], pos)
    la2, pos = a.append([b"third" * 100], pos)
    assert (a.read(la[0]), b.read(lb[0]), b.read(la2[0])) == (b"first" * 100, b"second" * 100, b"third" * 100)
    with pytest.raises(BlobGone):
        a.read(lost[0])
    a.close()
    b.close()


def test_a_log_without_a_recorded_end_continues_after_its_data(tmp_path: Path) -> None:
    # Logs written before the end was recorded (no zero-filled space): appends start at the file's end.
    d = tmp_path / "t.lg"
    d.mkdir()
    (d / "00000000.seg").write_bytes(b"x" * 1000)
    log = BlobLog(d)
    (loc,), pos = log.append([b"new"], None)
    assert LOCATOR.unpack(loc)[1] == 1000 and log.read(loc) == b"new"
    assert (d / "00000000.seg").read_bytes()[:1000] == b"x" * 1000
    log.close()


def test_segments_rotate_and_vacuum_keeps_only_live_records(tmp_path: Path) -> None:
    log = BlobLog(tmp_path / "t.lg", segment_max=100_000)
    locs, pos = [], None
    for i in range(10):
        (loc,), pos = log.append([bytes([i]) * 40_000], pos)
        locs.append(loc)
    segs = log.segments()
    assert len(segs) >= 3, segs
    keep = [locs[1], locs[9]]
    removed, punched = log.vacuum(keep, pos)
    assert removed >= 1 and punched > 0
    assert [log.read(x) for x in keep] == [bytes([1]) * 40_000, bytes([9]) * 40_000]
    for i, loc in enumerate(locs):
        if loc not in keep:
            with pytest.raises(BlobGone):
                log.read(loc)
    # The segment appends continue into is kept, with its zero-filled space after the end.
    assert log.segments()[-1] == segs[-1]
    assert _allocated(tmp_path / "t.lg") < 3 * 100_000
    # A second vacuum finds nothing more to do, and appends go on.
    assert log.vacuum(keep, pos) == (0, 0)
    (loc,), pos = log.append([b"after"], pos)
    assert log.read(loc) == b"after"
    log.close()


def test_a_damaged_locator_is_refused(tmp_path: Path) -> None:
    log = BlobLog(tmp_path / "t.lg")
    (loc,), _ = log.append([b"x" * 1000], None)
    seg, off, n, rid = LOCATOR.unpack(loc)
    with pytest.raises(BlobGone):
        log.read(LOCATOR.pack(seg, off, n, rid ^ 1))
    with pytest.raises(BlobGone):
        log.read(LOCATOR.pack(seg + 1, off, n, rid))
    log.close()


def _resident(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore(2) of a shared read-only mapping)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    size = path.stat().st_size
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return [b & 1 == 1 for b in vec.raw]
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_appended_bytes_leave_the_page_cache_behind_a_window(tmp_path: Path) -> None:
    # Only the newest cache_keep bytes stay cached once durable; everything older is dropped, so a
    # sustained write rate does not grow the page cache (and the values still read back).
    keep = 1 << 20
    log = BlobLog(tmp_path / "t.lg", cache_keep=keep)
    locs, pos = [], None
    for i in range(24):
        (loc,), pos = log.append([bytes([i + 1]) * 256 * 1024], pos)
        locs.append(loc)
    seg_end = pos[1]
    pages = _resident(tmp_path / "t.lg" / "00000000.seg")
    page = mmap.PAGESIZE
    old = pages[: (seg_end - 2 * keep) // page]
    new = pages[(seg_end - keep // 2) // page: seg_end // page]
    assert old and not any(old), f"{sum(old)} of {len(old)} old pages still cached"
    assert new and all(new)
    assert [log.read(x) for x in locs] == [bytes([i + 1]) * 256 * 1024 for i in range(24)]
    log.close()


# -- the saver on a SQLite store -----------------------------------------------------------------


@pytest.fixture
def sq(tmp_path: Path):
    store = Store(SQLiteBackend(tmp_path / "store"))
    _, key = store.operator.create_tenant("lg")
    ts = store.tenant(store.authenticate(key.secret))
    yield store, ts
    store.close()


def _put(saver: MoorageSaver, thread: str, values: dict, step: int, config: dict | None = None) -> dict:
    cp = empty_checkpoint()
    cp["channel_values"] = values
    cp["channel_versions"] = {ch: step for ch in values}
    config = config or {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    return saver.put(config, cp, {"step": step}, dict(cp["channel_versions"]))


def _latest(saver: MoorageSaver, thread: str) -> dict:
    tup = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": ""}})
    assert tup is not None
    return tup.checkpoint["channel_values"]


def _marker(tag: str) -> str:
    m = f"{tag}-{uuid.uuid4().hex}-"
    return (m * (BIG // len(m) + 1))[:BIG]


def test_large_values_live_in_the_log_not_in_the_database(sq) -> None:
    store, ts = sq
    saver = MoorageSaver(ts)
    big, small = _marker("big"), _marker("small")[:300]
    _put(saver, "th", {"doc": big, "title": small}, 1)
    assert _latest(saver, "th") == {"doc": big, "title": small}
    rows = ts.read("SELECT channel, type, length(blob) FROM lg_blobs")
    assert rows == [("doc", "log:msgpack", LOCATOR.size)]
    root = store.backend.root  # type: ignore[attr-defined]
    needle = big[:40].encode()
    # Written once: in a log segment, neither in the database file nor its WAL.
    assert _files_with(root, needle) == ["00000000.seg"]
    # A saver with the log switched off still reads what is in it, and writes rows again.
    plain = MoorageSaver(ts, log_min=0)
    assert _latest(plain, "th")["doc"] == big
    _put(plain, "th2", {"doc": big}, 1)
    assert ts.read("SELECT type FROM lg_blobs WHERE thread_id = 'th2'") == [("msgpack",)]
    # list() merges log values too.
    listed = list(saver.list({"configurable": {"thread_id": "th"}}))
    assert listed[0].checkpoint["channel_values"]["doc"] == big


def test_deleting_a_thread_removes_its_bytes_from_every_file(sq) -> None:
    store, ts = sq
    saver = MoorageSaver(ts)
    gone, kept = _marker("gone"), _marker("kept")
    _put(saver, "a", {"doc": gone}, 1)
    _put(saver, "b", {"doc": kept}, 1)
    saver.delete_thread("a")
    root = store.backend.root  # type: ignore[attr-defined]
    assert _files_with(root, gone[:40].encode()) == []
    assert _latest(saver, "b")["doc"] == kept
    assert saver.get_tuple({"configurable": {"thread_id": "a", "checkpoint_ns": ""}}) is None


def test_prune_and_delete_for_runs_release_values(sq) -> None:
    store, ts = sq
    saver = MoorageSaver(ts)
    olds = [_marker(f"old{i}") for i in range(3)]
    config = None
    for i, v in enumerate(olds, start=1):
        config = _put(saver, "p", {"doc": v}, i, config)
    saver.prune(["p"])
    root = store.backend.root  # type: ignore[attr-defined]
    assert _files_with(root, olds[0][:40].encode()) == []
    assert _files_with(root, olds[1][:40].encode()) == []
    assert _latest(saver, "p")["doc"] == olds[2]

    run_value = _marker("run")
    cp = empty_checkpoint()
    cp["channel_values"] = {"doc": run_value}
    cp["channel_versions"] = {"doc": 1}
    saver.put({"configurable": {"thread_id": "r", "checkpoint_ns": ""}}, cp, {"run_id": "run-1"}, {"doc": 1})
    saver.delete_for_runs(["run-1"])
    assert _files_with(root, run_value[:40].encode()) == []


def test_a_copied_thread_keeps_its_values_when_the_source_is_deleted(sq) -> None:
    _, ts = sq
    saver = MoorageSaver(ts)
    v = _marker("copy")
    _put(saver, "src", {"doc": v}, 1)
    saver.copy_thread("src", "dst")
    src_loc = ts.read("SELECT blob FROM lg_blobs WHERE thread_id = 'src'")[0][0]
    dst_loc = ts.read("SELECT blob FROM lg_blobs WHERE thread_id = 'dst'")[0][0]
    assert src_loc != dst_loc
    saver.delete_thread("src")
    assert _latest(saver, "dst")["doc"] == v


def test_large_pending_writes_live_in_the_log_and_leave_with_their_checkpoints(sq) -> None:
    # A task's large write goes to the log like a large channel value: written once, read back with its
    # checkpoint (get and list), copied with a copied thread, punched out when prune, delete_for_runs or
    # delete_thread removes it, and kept by the vacuum while its row lives.
    store, ts = sq
    saver = MoorageSaver(ts)
    root = store.backend.root  # type: ignore[attr-defined]
    w1, w2, w3, small = _marker("w1"), _marker("w2"), _marker("w3"), "tiny"

    def step(thread: str, n: int, config: dict | None, write: str, run: str | None = None) -> dict:
        cp = empty_checkpoint()
        cp["channel_values"] = {"n": n}
        cp["channel_versions"] = {"n": n}
        config = config or {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        config = saver.put(config, cp, {"step": n, **({"run_id": run} if run else {})}, {"n": n})
        saver.put_writes(config, [("doc", write), ("note", small)], task_id=f"task{n}")
        return config

    config = step("pw", 1, None, w1)
    assert ts.read("SELECT channel, type, length(blob) FROM lg_writes ORDER BY channel") == [
        ("doc", "log:msgpack", LOCATOR.size), ("note", "msgpack", len(saver.serde.dumps_typed(small)[1]))]
    assert _files_with(root, w1[:40].encode()) == ["00000000.seg"]
    got = saver.get_tuple(config)
    assert got is not None and got.pending_writes == [("task1", "doc", w1), ("task1", "note", small)]
    assert next(iter(saver.list({"configurable": {"thread_id": "pw"}}))).pending_writes[0] == ("task1", "doc", w1)

    saver.copy_thread("pw", "pw-copy")
    assert len({r[0] for r in ts.read("SELECT blob FROM lg_writes WHERE type LIKE 'log:%'")}) == 2  # own records
    step("pw", 2, config, w2)
    saver.prune(["pw"])  # keeps checkpoint 2 only: w1's write goes, the copy's stays
    # The vacuum keeps every write a row refers to (and finds nothing else to reclaim).
    assert store.backend.vacuum_blobs(ts.tenant_id)[1] == 0
    copy = saver.get_tuple({"configurable": {"thread_id": "pw-copy", "checkpoint_ns": ""}})
    assert copy is not None and copy.pending_writes[0] == ("task1", "doc", w1)
    saver.delete_thread("pw-copy")
    assert _files_with(root, w1[:40].encode()) == []
    assert saver.get_tuple({"configurable": {"thread_id": "pw", "checkpoint_ns": ""}}).pending_writes[0][2] == w2

    step("runs", 1, None, w3, run="run-9")
    saver.delete_for_runs(["run-9"])
    assert _files_with(root, w3[:40].encode()) == []
    saver.delete_thread("pw")
    assert _files_with(root, w2[:40].encode()) == []
    assert ts.read("SELECT count(*) FROM lg_writes") == [(0,)]


def test_inside_a_callers_transaction_deletes_wait_for_the_commit(sq) -> None:
    _, ts = sq
    saver = MoorageSaver(ts)
    v = _marker("tx")
    _put(saver, "t", {"doc": v}, 1)
    with pytest.raises(RuntimeError):
        with ts.transaction():
            saver.delete_thread("t")
            raise RuntimeError("roll back")
    # The delete rolled back, and nothing was punched while it could still roll back.
    assert _latest(saver, "t")["doc"] == v


def test_a_rolled_back_append_is_written_over_and_deletes_are_vacuumed(sq) -> None:
    store, ts = sq
    saver = MoorageSaver(ts)
    keep, orphan, later = _marker("keep"), _marker("orphan"), _marker("later")
    _put(saver, "k", {"doc": keep}, 1)
    # A transaction that appended to the log and then rolled back did not move the recorded end...
    with pytest.raises(RuntimeError):
        with ts.transaction():
            _put(saver, "o", {"doc": orphan}, 1)
            raise RuntimeError("roll back")
    root = store.backend.root  # type: ignore[attr-defined]
    assert _files_with(root, orphan[:40].encode()) == ["00000000.seg"]
    # ...so the next append writes over its bytes.
    _put(saver, "l", {"doc": later}, 1)
    assert _files_with(root, orphan[:40].encode()) == []
    # A delete inside a caller's transaction leaves its bytes for the vacuum (the sweeper runs it).
    with ts.transaction():
        saver.delete_thread("l")
    assert _files_with(root, later[:40].encode()) == ["00000000.seg"]
    ts.sweep()
    assert _files_with(root, later[:40].encode()) == []
    assert _latest(saver, "k")["doc"] == keep


def test_the_vacuum_lets_writers_go_on_and_locks_only_to_unlink_a_segment(sq) -> None:
    """The sweeper's vacuum reads its snapshot and punches while another connection holds the tenant's write
    lock (writers are not stopped for a scan of every row); unlinking a dead segment waits for the lock."""
    import sqlite3
    import threading

    from moorage.store.sqlite import _log_dir

    store, ts = sq
    backend = store.backend
    db = str(backend.tenant_path(ts.tenant_id))  # type: ignore[attr-defined]
    backend._tenant_conn(ts.tenant_id)  # type: ignore[attr-defined]
    backend._logs[db] = BlobLog(_log_dir(db), segment_max=3 * BIG)  # type: ignore[attr-defined]  # two values a segment
    saver = MoorageSaver(ts)
    values = [_marker(f"v{i}") for i in range(7)]
    for i, v in enumerate(values):
        _put(saver, f"t{i}", {"doc": v}, 1)
    log = backend.blob_log(ts.tenant_id)  # type: ignore[attr-defined]
    assert len(log.segments()) >= 4
    root = backend.root  # type: ignore[attr-defined]

    def vacuum_while_locked(release_after: float | None) -> tuple[float, tuple[int, int]]:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # a writer in the middle of its transaction
        out: list = []
        t0 = time.monotonic()
        th = threading.Thread(target=lambda: out.append(backend.vacuum_blobs(ts.tenant_id)), daemon=True)
        th.start()
        th.join(timeout=release_after if release_after is not None else 10)
        if release_after is not None:
            assert th.is_alive(), "the vacuum unlinked a segment without the write lock"
            blocker.execute("ROLLBACK")
            th.join(timeout=30)
        else:
            blocker.execute("ROLLBACK")
        blocker.close()
        assert not th.is_alive() and out, "the vacuum never finished"
        return time.monotonic() - t0, out[0]

    # Dead bytes in a segment that still holds a live value: punched with the lock held elsewhere.
    with ts.transaction():
        saver.delete_thread("t3")  # inside a caller's transaction: left for the vacuum
    took, (removed, punched) = vacuum_while_locked(None)
    assert removed == 0 and punched > 0 and took < 10
    assert _files_with(root, values[3][:40].encode()) == []
    # A whole segment dead: unlinking it waits for the write lock, then happens.
    with ts.transaction():
        saver.delete_thread("t0")
        saver.delete_thread("t1")
    first = log.segments()[0]
    _, (removed, _) = vacuum_while_locked(0.5)
    assert removed == 1 and first not in log.segments()
    for i in (2, 4, 5, 6):
        assert _latest(saver, f"t{i}")["doc"] == values[i]
    _put(saver, "after", {"doc": values[0]}, 1)  # appends go on
    assert _latest(saver, "after")["doc"] == values[0]


def test_a_value_missing_from_the_log_is_reported_as_damage(sq) -> None:
    _, ts = sq
    saver = MoorageSaver(ts)
    _put(saver, "d", {"doc": _marker("dmg")}, 1)
    loc = ts.read("SELECT blob FROM lg_blobs")[0][0]
    ts.backend.blob_log(ts.tenant_id).release([loc])  # type: ignore[union-attr]
    with pytest.raises(UnavailableError, match="blob log"):
        saver.get_tuple({"configurable": {"thread_id": "d", "checkpoint_ns": ""}})
    with pytest.raises(UnavailableError, match="blob log"):
        list(saver.list({"configurable": {"thread_id": "d"}}))


def test_dropping_the_tenant_removes_its_log(sq) -> None:
    store, ts = sq
    _put(MoorageSaver(ts), "x", {"doc": _marker("drop")}, 1)
    lg = store.backend.tenant_path(ts.tenant_id).with_suffix(".lg")  # type: ignore[attr-defined]
    assert any(lg.iterdir())
    store.backend.drop_tenant(ts.tenant_id)
    assert not lg.exists()


def test_sigkill_of_a_writer_never_loses_an_acknowledged_checkpoint(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 'store'}"
    store = open_store(Config(store_url=url))
    _, key = store.operator.create_tenant("crash")
    ts: TenantStore = store.tenant(store.authenticate(key.secret))
    env = {**os.environ, "MOORAGE_TEST_KEY": key.secret, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    rng = random.Random(11)
    acked: list[tuple[str, int, str]] = []
    for kill in range(6):
        p = subprocess.Popen([sys.executable, str(WORKERS), "lgput", url, str(kill * 100_000)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        time.sleep(rng.uniform(0.3, 1.0))
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        # Only complete lines were acknowledged (a line cut by the kill was not fully printed).
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit():
                acked.append((parts[0], int(parts[1]), parts[2]))
    assert len(acked) > 20, "the writer acknowledged too little for the test to mean anything"
    saver = MoorageSaver(ts)
    for thread, step, cid in acked:
        tup = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": cid}})
        assert tup is not None, (thread, step)
        assert tup.checkpoint["channel_values"] == {ch: lg_value(thread, step, ch) for ch in ("a", "b")}
    # Records appended by puts the kill cut short are orphans; a vacuum reclaims them and keeps the rest.
    store.backend.vacuum_blobs(ts.tenant_id)  # type: ignore[attr-defined]
    thread, step, cid = acked[-1]
    tup = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": cid}})
    assert tup is not None and tup.checkpoint["channel_values"]["a"] == lg_value(thread, step, "a")
    store.close()
