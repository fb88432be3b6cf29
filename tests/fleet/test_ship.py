"""Shipping a sandbox directory through the object store: exact copies, only changed chunks move, damage is refused."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from moorage.fleet.ship import Shipper, SnapshotUnavailable
from moorage.objects import ObjectStore

CHUNK = 64 * 1024


def _tree(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel.startswith(".ship-index"):
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes(), st.st_mtime_ns)
    return out


def _make(src: Path) -> None:
    (src / "layer" / "work" / "deep").mkdir(parents=True)
    (src / "layer" / "work" / "notes.txt").write_text("hello")
    (src / "layer" / "work" / "empty").write_bytes(b"")
    (src / "layer" / "work" / "deep" / "big.bin").write_bytes(os.urandom(5 * CHUNK + 123))
    with open(src / "layer" / "work" / "sparse.img", "wb") as f:  # holes in the middle
        f.write(b"A" * 100)
        f.seek(10 * CHUNK)
        f.write(b"B" * 100)
    os.chmod(src / "layer" / "work" / "notes.txt", 0o640)
    os.symlink("notes.txt", src / "layer" / "work" / "link")
    (src / "run").mkdir()
    (src / "meta.json").write_text(json.dumps({"state": "sleeping"}))


def _include(rel: str) -> bool:
    return not (rel == "run" or rel.startswith("run/"))


def test_push_pull_is_exact_and_only_changed_chunks_move(object_store: ObjectStore, tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir()
    _make(src)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(src / "layer" / "work" / "sock"))  # host-local: never shipped
    ship = Shipper(object_store, chunk_bytes=CHUNK)
    first = ship.push(src, "instances/t/i1", "s1", include=_include)
    assert first.chunks_moved == 1 + 1 + 6 + 2  # notes, meta, big (6 chunks), sparse (2 chunks; 9 holes)
    got = ship.pull(first.key, "instances/t/i1", dst)
    expected = {k: v for k, v in _tree(src).items() if k not in ("run", "layer/work/sock")}
    assert _tree(dst) == expected
    assert (dst / "layer/work/sparse.img").stat().st_size == 10 * CHUNK + 100
    assert os.stat(dst / "layer/work/sparse.img").st_blocks * 512 < 4 * CHUNK  # still sparse
    assert got.chunks_moved == first.chunks_moved

    # One chunk of the big file changes: a second push sends that chunk only, reading nothing else again.
    with open(src / "layer/work/deep/big.bin", "r+b") as f:
        f.seek(2 * CHUNK + 5)
        f.write(b"changed")
    second = ship.push(src, "instances/t/i1", "s2", include=_include)
    assert second.chunks_moved == 1
    # The older copy on another host fetches that one chunk and copies the rest from itself.
    again = ship.pull(second.key, "instances/t/i1", dst)
    assert again.chunks_moved == 1
    assert (dst / "layer/work/deep/big.bin").read_bytes() == (src / "layer/work/deep/big.bin").read_bytes()
    # Pushing the pulled copy back sends nothing: it already is what the store holds.
    assert ship.push(dst, "instances/t/i1", "s3", include=_include).chunks_moved == 0
    srv.close()


def test_damaged_or_missing_objects_refuse_and_keep_the_local_copy(harness, tmp_path: Path) -> None:  # noqa: ANN001
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir()
    _make(src)
    ship = Shipper(harness.store, chunk_bytes=CHUNK)
    rep = ship.push(src, "instances/t/i2", "s1", include=_include)
    ship.pull(rep.key, "instances/t/i2", dst)
    before = _tree(dst)
    (src / "layer/work/notes.txt").write_text("newer")
    rep2 = ship.push(src, "instances/t/i2", "s2", include=_include)
    chunk_keys = [o.key for o in harness.store.iter("instances/t/i2/chunks/")]
    notes_digest = next(e for e in ship.read_manifest(rep2.key)["entries"] if e["path"] == "layer/work/notes.txt")["chunks"][0]
    harness.corrupt(f"instances/t/i2/chunks/{notes_digest}")
    with pytest.raises(SnapshotUnavailable, match="damaged"):
        ship.pull(rep2.key, "instances/t/i2", dst)
    assert _tree(dst) == before  # nothing of the bad snapshot landed
    harness.store.delete(f"instances/t/i2/chunks/{notes_digest}")
    with pytest.raises(SnapshotUnavailable, match="missing"):
        ship.pull(rep2.key, "instances/t/i2", dst)
    with pytest.raises(SnapshotUnavailable, match="not in the object store"):
        ship.pull("instances/t/i2/snapshots/nope.json", "instances/t/i2", dst)
    assert _tree(dst) == before
    assert len(chunk_keys) >= 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pull-")]


@pytest.mark.parametrize("entries", [
    [{"path": "../escape", "type": "file", "mode": 420, "uid": 0, "gid": 0, "size": 0, "mtime_ns": 0, "chunks": []}],
    [{"path": "/etc/x", "type": "dir", "mode": 493, "uid": 0, "gid": 0}],
    [{"path": "l", "type": "link", "target": "OUTSIDE", "mode": 511, "uid": 0, "gid": 0},
     {"path": "l/x", "type": "file", "mode": 420, "uid": 0, "gid": 0, "size": 0, "mtime_ns": 0, "chunks": []}],
])
def test_a_manifest_cannot_write_outside_its_directory(object_store: ObjectStore, tmp_path: Path, entries: list) -> None:
    key = "instances/t/i3/snapshots/bad.json"
    outside = tmp_path / "outside"
    outside.mkdir()
    entries = [{**e, "target": str(outside)} if e.get("target") == "OUTSIDE" else e for e in entries]
    object_store.put_bytes(key, json.dumps({"version": 1, "chunk_bytes": CHUNK, "entries": entries}).encode())
    with pytest.raises(SnapshotUnavailable):
        Shipper(object_store).pull(key, "instances/t/i3", tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and not (tmp_path / "escape").exists()
    assert list(outside.iterdir()) == []


def test_prune_keeps_the_newest_snapshots_and_only_their_chunks(object_store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "a"
    src.mkdir()
    _make(src)
    prefix = "instances/t/pruned"
    ship = Shipper(object_store, chunk_bytes=CHUNK)
    keys = []
    for i in range(5):  # each shipment changes notes.txt (a chunk of its own), the big file stays shared
        (src / "layer/work/notes.txt").write_text(f"turn {i}")
        keys.append(ship.push(src, prefix, f"{i:06d}-s", include=_include).key)
        assert ship.prune(src, prefix, keep=2) == ((0, 0) if i < 2 else (1, 1))  # the dropped one's own chunk

    def chunks() -> set[str]:
        return {o.key.rsplit("/", 1)[1] for o in object_store.iter(f"{prefix}/chunks/")}

    assert sorted(o.key for o in object_store.iter(f"{prefix}/snapshots/")) == keys[-2:]
    kept = set()
    for key in keys[-2:]:
        kept |= {d for e in ship.read_manifest(key)["entries"] for d in e.get("chunks") or () if d}
    assert chunks() == kept  # nothing else is stored, and every kept snapshot still pulls whole
    for key in keys[-2:]:
        dst = tmp_path / key.rsplit("/", 1)[1]
        ship.pull(key, prefix, dst)
        assert (dst / "layer/work/deep/big.bin").read_bytes() == (src / "layer/work/deep/big.bin").read_bytes()
    # The directory's index no longer counts on deleted chunks: going back to an older content sends it again,
    # and the snapshot made then pulls whole.
    (src / "layer/work/notes.txt").write_text("turn 0")
    again = ship.push(src, prefix, "000009-s", include=_include)
    assert again.chunks_moved == 1
    ship.pull(again.key, prefix, tmp_path / "again")
    assert (tmp_path / "again/layer/work/notes.txt").read_text() == "turn 0"
    with pytest.raises(ValueError):
        ship.prune(src, prefix, keep=0)


def test_hard_links_arrive_as_hard_links_and_are_read_once(object_store: ObjectStore, tmp_path: Path) -> None:
    # A process sandbox's checkpoints link the files they share (process_snapshot): moved to another host, its
    # copy took one whole copy per checkpoint. The agent's own links inside its files stay links too.
    src, dst = tmp_path / "a", tmp_path / "b"
    big = os.urandom(3 * CHUNK + 7)
    (src / "checkpoints" / "c1" / "layer").mkdir(parents=True)
    (src / "checkpoints" / "c1" / "layer" / "data.bin").write_bytes(big)
    for c in ("c2", "c3"):
        (src / "checkpoints" / c / "layer").mkdir(parents=True)
        os.link(src / "checkpoints" / "c1" / "layer" / "data.bin", src / "checkpoints" / c / "layer" / "data.bin")
    (src / "layer" / "work").mkdir(parents=True)
    (src / "layer" / "work" / "x").write_text("shared by two names")
    os.link(src / "layer" / "work" / "x", src / "layer" / "work" / "y")
    ship = Shipper(object_store, chunk_bytes=CHUNK)
    rep = ship.push(src, "instances/t/links", "s1", include=_include)
    assert rep.chunks_moved == 4 + 1  # data.bin (4 chunks) and x, once each

    ship.pull(rep.key, "instances/t/links", dst)
    assert _tree(dst) == _tree(src)
    names = [dst / "checkpoints" / c / "layer" / "data.bin" for c in ("c1", "c2", "c3")]
    assert len({os.stat(p).st_ino for p in names}) == 1 and os.stat(names[0]).st_nlink == 3  # one copy on disk
    assert os.stat(dst / "layer/work/x").st_ino == os.stat(dst / "layer/work/y").st_ino
    assert ship.push(dst, "instances/t/links", "s2", include=_include).chunks_moved == 0

    # A manifest written before links were recorded (no same_as) still arrives whole, as copies.
    body = json.loads(object_store.get_bytes(rep.key))
    for e in body["entries"]:
        e.pop("same_as", None)
    object_store.put_bytes("instances/t/links/snapshots/old.json", json.dumps(body).encode())
    ship.pull("instances/t/links/snapshots/old.json", "instances/t/links", tmp_path / "c")
    assert _tree(tmp_path / "c") == _tree(src)
    assert os.stat(tmp_path / "c/layer/work/x").st_ino != os.stat(tmp_path / "c/layer/work/y").st_ino


def test_a_manifest_link_to_a_file_not_before_it_is_refused(object_store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "a"
    (src / "w").mkdir(parents=True)
    (src / "w" / "f").write_text("x")
    ship = Shipper(object_store, chunk_bytes=CHUNK)
    rep = ship.push(src, "instances/t/badlink", "s1", include=_include)
    body = json.loads(object_store.get_bytes(rep.key))
    body["entries"] = [e if e["path"] != "w/f" else {**e, "same_as": "/etc/passwd"} for e in body["entries"]]
    object_store.put_bytes(rep.key, json.dumps(body).encode())
    with pytest.raises(SnapshotUnavailable):
        ship.pull(rep.key, "instances/t/badlink", tmp_path / "b")
    body["entries"] = [e if e["path"] != "w/f" else {**e, "same_as": "w/g"} for e in body["entries"]]
    object_store.put_bytes(rep.key, json.dumps(body).encode())
    with pytest.raises(SnapshotUnavailable):
        ship.pull(rep.key, "instances/t/badlink", tmp_path / "b")
    assert not (tmp_path / "b").exists()
