"""A wake that reads a chunk back damaged or cut short reads it again before it gives the snapshot up, on both
object stores (local files, SeaweedFS): a read garbled once resumes from the newest snapshot, with the turns it
holds; a chunk damaged for good still falls back to the instance's older snapshot, and says so loudly.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

import pytest

from moorage.fleet.member import FleetMember
from moorage.fleet.ship import Shipper
from moorage.objects import ObjectCorrupt, ObjectStore
from moorage.store import SandboxRecord

CHUNK = 64 * 1024


class Garbling:
    """The object store as a flaky network shows it: the first ``times`` reads of ``key`` come back cut short
    (the bytes that came are written out, then the read fails its length and digest check, as a real one does)."""

    def __init__(self, store: ObjectStore, key: str, times: int) -> None:
        self.store, self.key, self.times, self.reads = store, key, times, 0

    def get_stream(self, key: str, out: BinaryIO) -> Any:
        if key != self.key:
            return self.store.get_stream(key, out)
        self.reads += 1
        if self.reads > self.times:
            return self.store.get_stream(key, out)
        buf = io.BytesIO()
        info = self.store.get_stream(key, buf)
        out.write(buf.getvalue()[: info.size // 2])
        raise ObjectCorrupt(key, f"its {info.size // 2} bytes hash to something else; {info.size} were recorded")

    def get_bytes(self, key: str, *, max_bytes: int = 16 << 20) -> bytes:
        buf = io.BytesIO()
        self.get_stream(key, buf)
        return buf.getvalue()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class _Driver:
    """What ``make_local`` asks of a sandbox driver (the process driver's rules for what travels)."""

    name = "process"

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def portable(rel: str) -> bool:
        return not rel.startswith(".")

    def forget_handle(self, sandbox_id: str) -> None:
        pass

    def adopt_fetched(self, sandbox_id: str) -> None:
        pass


def _record(sid: str, key: str) -> SandboxRecord:
    return SimpleNamespace(id=sid, lease_epoch=2, meta={"shipped": {"key": key, "at": 1.0}})  # type: ignore[return-value]


def _two_snapshots(store: ObjectStore, tmp_path: Path) -> tuple[FleetMember, str, str, str]:
    """An instance shipped twice from host A (its counter at 1, then at 2); returns (host B's member, the older
    manifest, the newer one, the key of the chunk only the newer one has)."""
    a = tmp_path / "a" / "sb1"
    (a / "layer" / "work").mkdir(parents=True)
    counter = a / "layer" / "work" / "counter.txt"
    shipper = Shipper(store, chunk_bytes=CHUNK)
    prefix = "instances/t1/sb1"
    counter.write_text("1")
    old = shipper.push(a, prefix, "000001-1", include=_Driver.portable).key
    counter.write_text("2")
    new = shipper.push(a, prefix, "000001-2", include=_Driver.portable).key
    body = json.loads(store.get_bytes(new))
    digest = next(e for e in body["entries"] if e["path"] == "layer/work/counter.txt")["chunks"][0]
    member = FleetMember(None, store, _Driver(tmp_path / "b"), host_id="hb", url="http://hb")  # type: ignore[arg-type]
    (tmp_path / "b").mkdir()
    return member, old, new, f"{prefix}/chunks/{digest}"


def test_a_chunk_read_back_cut_short_once_is_read_again_and_the_wake_keeps_the_newest_snapshot(
        harness, tmp_path: Path) -> None:  # noqa: ANN001
    member, _old, new, chunk = _two_snapshots(harness.store, tmp_path)
    flaky = Garbling(harness.store, chunk, times=1)
    member.objects = flaky  # type: ignore[assignment]
    member.shipper = Shipper(flaky, chunk_bytes=CHUNK)  # type: ignore[arg-type]
    resumed = member.make_local("t1", _record("sb1", new), previous_epoch=1)
    assert resumed["from"] == "shipped" and resumed["key"] == new and resumed["fallback"] is False, resumed
    assert (tmp_path / "b" / "sb1" / "layer" / "work" / "counter.txt").read_text() == "2"
    assert flaky.reads == 2
    member.shipper.close()


def test_a_chunk_damaged_for_good_still_falls_back_after_a_few_reads_and_says_so_loudly(
        harness, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    member, old, new, chunk = _two_snapshots(harness.store, tmp_path)
    flaky = Garbling(harness.store, chunk, times=1000)
    member.objects = flaky  # type: ignore[assignment]
    member.shipper = Shipper(flaky, chunk_bytes=CHUNK)  # type: ignore[arg-type]
    logging.getLogger("moorage").addHandler(caplog.handler)
    try:
        resumed = member.make_local("t1", _record("sb1", new), previous_epoch=1)
    finally:
        logging.getLogger("moorage").removeHandler(caplog.handler)
    assert resumed["from"] == "shipped" and resumed["key"] == old and resumed["fallback"] is True, resumed
    assert (tmp_path / "b" / "sb1" / "layer" / "work" / "counter.txt").read_text() == "1"
    assert 2 <= flaky.reads <= 4                                    # read again, a bounded number of times
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR and "older snapshot" in r.getMessage()]
    assert loud, [r.getMessage() for r in caplog.records]
    member.shipper.close()
