"""Listing a process sandbox's checkpoints while one is deleted (retention removes pruned ones outside the sandbox's
lock, renaming each aside first): the listing leaves the deleted one out instead of failing (a rollback that listed
them at that moment answered a 500; CI run of this session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moorage.sandbox import process_checkpoints


def test_a_checkpoint_deleted_while_listed_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = tmp_path / "box"
    (box / "layer" / "work").mkdir(parents=True)
    (box / "layer" / "work" / "note.txt").write_text("one")
    process_checkpoints.take(box, "box", "ck-1")
    (box / "layer" / "work" / "note.txt").write_text("two")
    process_checkpoints.take(box, "box", "ck-2")

    real = process_checkpoints.dirs

    def deleted_meanwhile(sandbox_dir: Path) -> list[Path]:
        found = real(sandbox_dir)
        os.rename(found[0], found[0].with_name(".ck-1.deleting-x"))  # as Sandbox.delete_checkpoint does
        return found

    monkeypatch.setattr(process_checkpoints, "dirs", deleted_meanwhile)
    assert [c.name for c in process_checkpoints.listing(box, "box")] == ["ck-2"]
