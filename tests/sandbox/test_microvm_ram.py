"""RAM delta digests: snapshots record XXH3-128 now, and those recorded with SHA-256 before still wake."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from moorage.sandbox import microvm_ram as ram


def test_a_delta_matches_its_record_old_or_new_and_any_changed_byte_fails_both(tmp_path: Path) -> None:
    delta = tmp_path / "ram.delta"
    data = bytearray(b"".join(bytes([i % 256]) * ram.PAGE for i in range(300)))
    delta.write_bytes(data)
    new = {"delta_xxh3": ram.delta_digest(delta)}
    old = {"delta_sha256": hashlib.sha256(data).hexdigest()}
    assert ram.delta_matches(delta, new) and ram.delta_matches(delta, old)
    data[ram.PAGE * 123 + 7] ^= 1
    delta.write_bytes(data)
    assert not ram.delta_matches(delta, new) and not ram.delta_matches(delta, old)
    assert not ram.delta_matches(delta, {})  # no digest recorded: never taken as intact


def _private_mapping(tmp_path: Path, pages: int) -> tuple[object, "ram.Mapping", Path]:
    """A file mapped privately by this process, as QEMU maps a fork's template RAM: pages written become private
    copies (what ``copy_dirty`` reads)."""
    import ctypes
    import mmap

    tpl = tmp_path / "ram"
    tpl.write_bytes(bytes(pages * ram.PAGE))
    with open(tpl, "rb") as f:
        mm = mmap.mmap(f.fileno(), pages * ram.PAGE, access=mmap.ACCESS_COPY)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, ram.Mapping(start, start + pages * ram.PAGE, 0), tpl


def test_the_pauses_copy_buffer_is_reused_and_never_shared_by_two_copies_in_use(tmp_path: Path) -> None:
    """Each checkpoint's pause allocated a fresh zeroed buffer for the guest's private pages (up to 16 MiB, faulted
    in inside the pause); one is now kept for the next. A copy taken while another is still being compared gets a
    buffer of its own, and a compared copy's buffer serves the next."""
    import os

    mm, m, tpl = _private_mapping(tmp_path, 64)
    pid = os.getpid()
    for p in (3, 4, 40):
        mm[p * ram.PAGE : (p + 1) * ram.PAGE] = bytes([p]) * ram.PAGE  # type: ignore[index]
    first = ram.copy_dirty(pid, m)
    assert first is not None and first.runs == [(3, 2), (40, 1)] and len(first.data) == 3 * ram.PAGE
    buf = first._buf
    second = ram.copy_dirty(pid, m)  # the first not compared yet: another buffer
    assert second is not None and second._buf is not buf
    assert [p for p, _ in ram.changed_pages(pid, m, tpl, first)] == [3, 4, 40]
    mm[3 * ram.PAGE : 4 * ram.PAGE] = b"\x07" * ram.PAGE  # type: ignore[index]
    third = ram.copy_dirty(pid, m)  # the first's buffer, compared and handed back
    assert third is not None and third._buf is buf and bytes(third.data[:ram.PAGE]) == b"\x07" * ram.PAGE
    # The second copy still holds what the guest had when it was taken.
    assert [(p, c[:1]) for p, c in ram.changed_pages(pid, m, tpl, second)] == [(3, b"\x03"), (4, b"\x04"), (40, b"(")]
    with pytest.raises(ValueError):  # a copy is compared once: its buffer is another's after that
        list(ram.changed_pages(pid, m, tpl, first))
    third.release()
    mm.close()
