"""A shipment publishes its snapshot only while the instance's record still names its host at the epoch it shipped
under, read after the chunks are stored (``FleetMember.ship(held=...)``), on both object stores:

* the user forgotten while the chunks went up (a sleep shipped again after an outage, alongside a forget that
  deleted the instance's objects): no manifest, and the chunks it sent are removed again;
* another host took the instance over meanwhile: no manifest (that host's snapshots are the instance's), and
  what that host shipped is left alone;
* either of those between that read and the manifest's write (the host paused there: a forget served by another
  host meanwhile left the manifest it then wrote, the only object of the forgotten user in the bucket, once in a
  CI run of ``test_forget_fleet.py``): the record is read again after the write, and the manifest withdrawn;
* still held: published as before.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moorage.fleet.member import FleetMember, NotPublished
from moorage.objects import ObjectStore
from tests.fleet.test_ship_retry import _Driver


def _member(store: ObjectStore, tmp_path: Path) -> tuple[FleetMember, SimpleNamespace]:
    work = tmp_path / "sb1" / "layer" / "work"
    work.mkdir(parents=True)
    (work / "counter.txt").write_text("7")
    (work / "notes.txt").write_text("the user's notes " * 1000)
    member = FleetMember(None, store, _Driver(tmp_path), host_id="ha", url="http://ha")  # type: ignore[arg-type]
    return member, SimpleNamespace(id="sb1", host="ha", lease_epoch=2, state="sleeping", meta={})


def _keys(store: ObjectStore) -> list[str]:
    return sorted(o.key for o in store.iter("instances/t1/sb1/"))


def test_a_shipment_whose_user_was_forgotten_meanwhile_leaves_nothing(object_store: ObjectStore, tmp_path: Path) -> None:
    member, rec = _member(object_store, tmp_path)

    def forgotten_meanwhile() -> None:
        # The forget ran while the chunks went up (its deletion came before they landed): the record is gone.
        assert _keys(object_store), "the chunks are stored before the record is read"
        return None

    with pytest.raises(NotPublished, match="deleted meanwhile"):
        member.ship("t1", rec, 2, held=forgotten_meanwhile)  # type: ignore[arg-type]
    assert _keys(object_store) == []

    deleting = SimpleNamespace(**{**vars(rec), "state": "deleted"})  # being forgotten: the same
    with pytest.raises(NotPublished):
        member.ship("t1", rec, 2, held=lambda: deleting)  # type: ignore[arg-type]
    assert _keys(object_store) == []


def test_a_stale_holder_publishes_nothing_and_leaves_the_new_holders_snapshots(
        object_store: ObjectStore, tmp_path: Path) -> None:
    member, rec = _member(object_store, tmp_path)
    shipped = member.ship("t1", rec, 2, held=lambda: rec)  # type: ignore[arg-type]  # still held: published
    assert object_store.exists(shipped["key"])
    before = _keys(object_store)
    (tmp_path / "sb1" / "layer" / "work" / "counter.txt").write_text("8")
    taken = SimpleNamespace(**{**vars(rec), "host": "hb", "lease_epoch": 3})
    with pytest.raises(NotPublished, match="host 'hb' holds it now"):
        member.ship("t1", rec, 2, held=lambda: taken)  # type: ignore[arg-type]
    after = _keys(object_store)
    assert [k for k in after if "/snapshots/" in k] == [k for k in before if "/snapshots/" in k]
    assert set(before) <= set(after)



@pytest.mark.parametrize("outcome", ["deleted", "gone", "taken"])
def test_a_forget_or_a_takeover_between_the_read_and_the_manifest_withdraws_it(
        object_store: ObjectStore, tmp_path: Path, outcome: str) -> None:
    member, rec = _member(object_store, tmp_path)
    earlier = member.ship("t1", rec, 2, held=lambda: rec)["key"] if outcome == "taken" else None  # type: ignore
    (tmp_path / "sb1" / "layer" / "work" / "counter.txt").write_text("8")
    after = {"deleted": SimpleNamespace(**{**vars(rec), "state": "deleted", "host": "hb"}), "gone": None,
             "taken": SimpleNamespace(**{**vars(rec), "host": "hb", "lease_epoch": 3})}[outcome]
    reads: list[str] = []

    def held() -> SimpleNamespace | None:
        reads.append(outcome)
        if len(reads) > 1:
            return after
        # The record as read before the manifest: still this host's. Another host then marks it (forget: deleted,
        # and deletes the instance's objects) before this host writes the manifest.
        if outcome != "taken":
            object_store.delete_prefix("instances/t1/sb1/")
        return rec

    with pytest.raises(NotPublished):
        member.ship("t1", rec, 2, held=held)  # type: ignore[arg-type]
    assert len(reads) == 2  # read before the manifest, and again after it
    if outcome == "taken":  # what it published under its lease stays; the one written after is withdrawn
        assert [k for k in _keys(object_store) if "/snapshots/" in k] == [earlier]
    else:  # nothing of the forgotten user is left
        assert _keys(object_store) == []
