"""Incremental process-sandbox checkpoints: unchanged files are links to the previous checkpoint's copy, any change is
copied, and no checkpoint ever sees a later write."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from moorage.sandbox.process_fs import disk_usage
from moorage.sandbox.process_snapshot import snapshot_tree, write_index


def _take(layer: Path, base: Path, name: str, prev: Path | None) -> tuple[Path, dict]:
    ck = base / name
    ck.mkdir(parents=True)
    index = snapshot_tree(layer, ck / "layer", prev)
    write_index(ck, index)
    return ck, index


def _inodes(tree: Path) -> set[tuple[int, int]]:
    seen: set[tuple[int, int]] = set()
    disk_usage(tree, seen)
    return seen


def _age(path: Path) -> None:
    """Let ``path``'s last change be old enough to be trusted (its ctime is not within the racy window)."""
    time.sleep(0.15)


def test_unchanged_files_are_linked_changed_and_new_ones_copied(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "pkg").mkdir(parents=True)
    for i in range(20):
        (layer / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (layer / "notes.txt").write_text("first")
    _age(layer)
    a, ia = _take(layer, tmp_path / "ck", "a", None)
    assert ia["copied"] == 21 and ia["linked"] == 0

    (layer / "notes.txt").write_text("second")  # changed in place, same inode
    (layer / "new.txt").write_text("new")
    (layer / "pkg" / "m0.py").unlink()
    b, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ib["linked"] == 19 and ib["copied"] == 2
    assert os.stat(a / "layer" / "pkg" / "m5.py").st_ino == os.stat(b / "layer" / "pkg" / "m5.py").st_ino
    assert os.stat(a / "layer" / "notes.txt").st_ino != os.stat(b / "layer" / "notes.txt").st_ino
    # Each checkpoint is the layer as it was: the later write reached neither the older copy nor a shared inode.
    assert (a / "layer" / "notes.txt").read_text() == "first" and (b / "layer" / "notes.txt").read_text() == "second"
    assert (a / "layer" / "pkg" / "m0.py").exists() and not (b / "layer" / "pkg" / "m0.py").exists()
    assert not (a / "layer" / "new.txt").exists()
    # The live layer never shares an inode with a checkpoint.
    assert os.stat(layer / "pkg" / "m5.py").st_ino != os.stat(b / "layer" / "pkg" / "m5.py").st_ino
    # What each added is counted as it was made: exactly what a walk that skips files shared with older
    # checkpoints finds (here its two copies and its two directories), without walking the older ones.
    assert ia["added"] == disk_usage(a / "layer")
    assert ib["added"] == disk_usage(b / "layer", seen=_inodes(a / "layer")) < ia["added"]


def test_a_change_that_keeps_size_and_mtime_is_still_copied(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    f = layer / "data.bin"
    f.write_bytes(b"A" * 4096)
    _age(layer)
    a, _ = _take(layer, tmp_path / "ck", "a", None)
    st = os.stat(f)
    with open(f, "r+b") as h:  # same size, and the mtime put back as it was: only ctime tells
        h.write(b"B" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    b, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ib["copied"] == 1 and (b / "layer" / "data.bin").read_bytes() == b"B" * 4096
    assert (a / "layer" / "data.bin").read_bytes() == b"A" * 4096


def test_a_file_changed_just_before_the_checkpoint_is_copied_again_next_time(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    f = layer / "hot.txt"
    f.write_text("v1")
    a, ia = _take(layer, tmp_path / "ck", "a", None)  # no wait: its ctime is within the racy window
    assert "hot.txt" not in ia["files"]
    f.write_text("v2")  # may land in the same timestamp tick as the write the checkpoint saw
    b, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ib["linked"] == 0 and (b / "layer" / "hot.txt").read_text() == "v2"


def test_modes_owners_links_fifos_and_times_are_kept(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "d").mkdir(parents=True)
    (layer / "d" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(layer / "d" / "run.sh", 0o750)
    os.chown(layer / "d" / "run.sh", 64123, 64124)
    os.symlink("d/run.sh", layer / "link")
    os.link(layer / "d" / "run.sh", layer / "hard")
    os.mkfifo(layer / "pipe", 0o600)
    os.chmod(layer / "d", 0o710)
    os.utime(layer / "d", ns=(1_000_000_000, 2_000_000_000))
    _age(layer)
    a, _ = _take(layer, tmp_path / "ck", "a", None)
    for ck in (a, _take(layer, tmp_path / "ck", "b", a)[0]):
        got = ck / "layer"
        st = os.stat(got / "d" / "run.sh")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, 64123, 64124)
        assert os.readlink(got / "link") == "d/run.sh"
        assert os.stat(got / "hard").st_ino == st.st_ino  # a hard link inside the layer stays one
        assert stat.S_ISFIFO(os.lstat(got / "pipe").st_mode)
        dst = os.stat(got / "d")
        assert stat.S_IMODE(dst.st_mode) == 0o710 and dst.st_mtime_ns == 2_000_000_000


def test_an_index_from_another_filesystem_or_a_damaged_one_means_a_full_copy(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "f").write_text("x")
    _age(layer)
    a, _ = _take(layer, tmp_path / "ck", "a", None)
    (a / "index.json").write_text("{not json")
    _, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ib["linked"] == 0 and ib["copied"] == 1
