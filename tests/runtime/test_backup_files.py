"""What a backup copies (``runtime/backup_files.py``): the data directory as ``cp -a`` copies it, without the booted
templates' records and files, at whatever depth; links stay links, hard links stay shared, modes and holes kept."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from moorage.runtime.backup_files import BackupFailed, copy_but_booted


def _data_dir(root: Path) -> Path:
    data = root / "data"
    for d in ("templates/booted", "templates/t1", "sandboxes/.templates/boot-0123456789abcdef-aaaaaa",
              "sandboxes/.templates/tpl-1", "sandboxes/sb-1/checkpoints/c1", "packages"):
        (data / d).mkdir(parents=True)
    (data / "templates" / "booted" / "k.json").write_text("{}")
    (data / "templates" / "t1" / "record.json").write_text("{}")
    (data / "sandboxes" / ".templates" / "boot-0123456789abcdef-aaaaaa" / "ram").write_bytes(b"b" * 4096)
    (data / "sandboxes" / ".templates" / "tpl-1" / "disk").write_bytes(b"t" * 4096)
    disk = data / "sandboxes" / "sb-1" / "disk"
    with open(disk, "wb") as f:  # sparse: 64 MiB of which 4 KiB written
        f.seek(64 << 20)
        f.write(b"x")
    os.link(disk, data / "sandboxes" / "sb-1" / "checkpoints" / "c1" / "disk")
    (data / "local-admin.key").write_text("mrg_secret\n")
    os.chmod(data / "local-admin.key", 0o600)
    os.chmod(data / "sandboxes" / ".templates", 0o700)
    (data / "images").symlink_to(root / "shared-images")
    return data


def test_the_copy_leaves_out_booted_templates_and_keeps_everything_else_as_cp_a_would(tmp_path: Path) -> None:
    data, dest = _data_dir(tmp_path), tmp_path / "copy"
    asyncio.run(copy_but_booted(data, dest))
    assert not (dest / "templates" / "booted").exists()
    assert (dest / "templates" / "t1" / "record.json").read_text() == "{}"
    assert sorted(p.name for p in (dest / "sandboxes" / ".templates").iterdir()) == ["tpl-1"]
    assert (dest / "sandboxes" / ".templates").stat().st_mode & 0o777 == 0o700
    assert (dest / "local-admin.key").stat().st_mode & 0o777 == 0o600
    assert (dest / "images").is_symlink() and os.readlink(dest / "images") == str(tmp_path / "shared-images")
    disk, linked = dest / "sandboxes" / "sb-1" / "disk", dest / "sandboxes" / "sb-1" / "checkpoints" / "c1" / "disk"
    assert disk.stat().st_ino == linked.stat().st_ino  # a checkpoint's file shares the instance's, as it did
    assert disk.stat().st_size == (64 << 20) + 1 and disk.stat().st_blocks * 512 < 1 << 20  # holes kept
    assert (dest / "packages").is_dir()


def test_a_copy_that_cannot_be_written_says_which_part_failed(tmp_path: Path) -> None:
    data = _data_dir(tmp_path)
    (tmp_path / "copy").write_text("a file, not a directory")
    with pytest.raises(BackupFailed, match="copying .* failed") as e:
        asyncio.run(copy_but_booted(data / "sandboxes", tmp_path / "copy" / "sandboxes", "sandboxes"))
    assert e.value.hint and "free space" in e.value.hint
