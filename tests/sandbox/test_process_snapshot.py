"""Incremental process-sandbox checkpoints: unchanged files are links to the previous checkpoint's copy, any change is
copied, and no checkpoint ever sees a later write."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

from moorage.sandbox.base import SandboxError
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


def test_a_link_that_fails_falls_back_to_a_copy(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "pkg").mkdir(parents=True)
    (layer / "lib").mkdir()
    for rel in ("pkg/m0.py", "pkg/m1.py", "pkg/m2.py", "lib/l0.py", "lib/l1.py", "top.txt"):
        (layer / rel).write_text(rel)
    os.chmod(layer / "lib" / "l0.py", 0o640)
    _age(layer)
    a, _ = _take(layer, tmp_path / "ck", "a", None)
    # The older checkpoint lost one copy and a whole directory: linking those fails, so they are copied again.
    os.unlink(a / "layer" / "pkg" / "m1.py")
    for p in (a / "layer" / "lib").iterdir():
        p.unlink()
    os.rmdir(a / "layer" / "lib")
    b, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ib["linked"] == 3 and ib["copied"] == 3
    for rel in ("pkg/m0.py", "pkg/m1.py", "pkg/m2.py", "lib/l0.py", "lib/l1.py", "top.txt"):
        assert (b / "layer" / rel).read_text() == rel
        assert os.stat(b / "layer" / rel).st_ino != os.stat(layer / rel).st_ino
    assert stat.S_IMODE(os.stat(b / "layer" / "lib" / "l0.py").st_mode) == 0o640
    assert os.stat(b / "layer" / "pkg" / "m0.py").st_ino == os.stat(a / "layer" / "pkg" / "m0.py").st_ino
    assert sorted(ib["files"]) == ["lib/l0.py", "lib/l1.py", "pkg/m0.py", "pkg/m1.py", "pkg/m2.py", "top.txt"]
    assert ib["added"] == disk_usage(b / "layer", seen=_inodes(a / "layer"))
    _, ic = _take(layer, tmp_path / "ck", "c", b)  # the fresh copies are recorded: all linked next time
    assert ic["linked"] == 6 and ic["copied"] == 0


def test_nested_directories_hard_links_across_them_and_symlinks_out_of_the_layer(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "secret").write_text("SECRET")
    layer = tmp_path / "layer"
    (layer / "a" / "b" / "c").mkdir(parents=True)
    (layer / "e").mkdir()
    (layer / "a" / "b" / "c" / "deep.txt").write_text("deep")
    (layer / "a" / "x.txt").write_text("x")
    (layer / "e" / "y.txt").write_text("y")
    blob = os.urandom(3 << 20)
    (layer / "a" / "b" / "blob").write_bytes(blob)
    os.link(layer / "a" / "b" / "c" / "deep.txt", layer / "e" / "deep.hard")  # a hard link across directories
    os.symlink(outside, layer / "out")
    os.symlink("../../e", layer / "a" / "b" / "up")
    _age(layer)
    a, ia = _take(layer, tmp_path / "ck", "a", None)
    b, ib = _take(layer, tmp_path / "ck", "b", a)
    assert ia["copied"] == 4 and ia["linked"] == 0  # four distinct files; the second name of one is a link to it
    assert ib["copied"] == 0 and ib["linked"] == 4
    # One of the two names of the hard-linked file is recorded (the other is linked to its copy at each checkpoint).
    assert len({"a/b/c/deep.txt", "e/deep.hard"} & set(ia["files"])) == 1 and len(ia["files"]) == 4
    assert ib["files"] == ia["files"]
    for ck in (a, b):
        got = ck / "layer"
        assert os.stat(got / "a" / "b" / "c" / "deep.txt").st_ino == os.stat(got / "e" / "deep.hard").st_ino
        assert (got / "e" / "deep.hard").read_text() == "deep" and (got / "a" / "b" / "blob").read_bytes() == blob
        assert os.readlink(got / "out") == str(outside) and os.readlink(got / "a" / "b" / "up") == "../../e"
        assert not any(p.is_file() and not p.is_symlink() and p.read_text(errors="replace") == "SECRET"
                       for p in got.rglob("*"))
    assert os.stat(a / "layer" / "a" / "b" / "blob").st_ino == os.stat(b / "layer" / "a" / "b" / "blob").st_ino


def test_a_directory_swapped_for_a_symlink_during_the_walk_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "f").write_text("SECRET")
    layer = tmp_path / "layer"
    (layer / "d").mkdir(parents=True)
    (layer / "d" / "f").write_text("inside")
    # A big file the walk examines after d (a directory's order is the filesystem's: rename until it is so) and copies
    # before it descends into d, the window in which the guest below swaps d for a symlink out of the layer.
    big = layer / "big0"
    big.write_bytes(b"x" * (64 << 20))
    for i in range(1, 100):
        if os.listdir(layer).index("d") < os.listdir(layer).index(big.name):
            break
        big = big.rename(layer / f"big{i}")
    assert os.listdir(layer).index("d") < os.listdir(layer).index(big.name)
    dst = tmp_path / "ck" / "layer"
    dst.parent.mkdir()
    done = threading.Event()

    def guest() -> None:
        """The still-running guest swaps d for a symlink out of the layer while the checkpoint copies the big file."""
        while not (dst / big.name).exists():
            if done.wait(0.0005):
                return
        os.rename(layer / "d", layer / ".d")
        os.symlink(outside / "d", layer / "d")

    swapper = threading.Thread(target=guest)
    swapper.start()
    try:
        snapshot_tree(layer, dst, None)
    except (SandboxError, FileNotFoundError):
        pass  # the walk met the symlink (or the moment d was missing) and refused
    finally:
        done.set()
        swapper.join()
    # Whether it refused or the swap came after the walk had opened d, nothing from outside the layer was copied.
    assert not any(p.is_file() and not p.is_symlink() and p.read_bytes() == b"SECRET" for p in dst.rglob("*"))
    assert not (dst / "d").is_dir() or (dst / "d").is_symlink() or (dst / "d" / "f").read_text() == "inside"
