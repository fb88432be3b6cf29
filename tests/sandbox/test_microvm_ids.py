"""The machine-wide registry of micro-VM uids (``microvm_user.vm_id``/``release``), without QEMU: one slot per
existing sandbox or template directory, found again across holes that released claims leave, taken over when
its directory is gone, given back when it is removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moorage.sandbox import microvm_user
from moorage.sandbox.microvm_user import VM_ID_BASE


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    reg = tmp_path / "ids"
    monkeypatch.setattr(microvm_user, "REGISTRY", reg)
    # Every directory hashes to slot 5: the collisions the probe window exists for.
    monkeypatch.setattr(microvm_user, "_start", lambda key: 5)
    return reg


def _dirs(tmp_path: Path, *names: str) -> list[Path]:
    out = []
    for n in names:
        (tmp_path / n).mkdir()
        out.append(tmp_path / n)
    return out


def test_claims_are_stable_found_past_holes_and_given_back(registry: Path, tmp_path: Path) -> None:
    a, b, c = _dirs(tmp_path, "a", "b", "c")
    assert [microvm_user.vm_id(d) for d in (a, b)] == [VM_ID_BASE + 5, VM_ID_BASE + 6]
    assert microvm_user.vm_id(b) == VM_ID_BASE + 6  # the same uid at every launch
    microvm_user.release(a)
    assert sorted(os.listdir(registry)) == [".lock", "6"]
    # b is still found behind the hole a left (it must not get a second slot and a new uid).
    assert microvm_user.vm_id(b) == VM_ID_BASE + 6
    assert microvm_user.vm_id(c) == VM_ID_BASE + 5  # a new directory takes the free slot
    microvm_user.release(b)
    microvm_user.release(b)  # twice, or for a directory never claimed: nothing happens
    microvm_user.release(tmp_path / "never")
    assert {e: os.readlink(registry / e) for e in os.listdir(registry) if e != ".lock"} == {"5": str(c.resolve())}


def test_a_claim_whose_directory_is_gone_is_taken_over_but_an_existing_one_never(registry: Path, tmp_path: Path) -> None:
    a, b, c = _dirs(tmp_path, "a", "b", "c")
    assert microvm_user.vm_id(a) == VM_ID_BASE + 5
    assert microvm_user.vm_id(b) == VM_ID_BASE + 6
    a.rmdir()  # removed without giving its slot back (a host that crashed mid-destroy)
    assert microvm_user.vm_id(b) == VM_ID_BASE + 6  # b keeps its uid although an earlier slot is stale
    assert microvm_user.vm_id(c) == VM_ID_BASE + 5
    assert os.readlink(registry / "5") == str(c.resolve())
