"""RAM delta digests: snapshots record XXH3-128 now, and those recorded with SHA-256 before still wake."""

from __future__ import annotations

import hashlib
from pathlib import Path

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
