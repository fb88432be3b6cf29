"""The object store down while agents sleep, are shipped and wake on other hosts (process driver, real SeaweedFS
behind a relay that goes down as the server would): no data loss, a clear error, the agent usable on its host.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.fleet.harness import Fleet, Relay, put_to_sleep, relayed_fleet, replied, until


def _fleet(name: str, tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket,  # noqa: ANN001
           relay: Relay, **settings: str) -> Iterator[Fleet]:
    yield from relayed_fleet(tmp_path_factory.mktemp(name), pg_cluster.create_database(name), seaweedfs, s3_bucket,
                             relay, n=2, checkpoint_interval_s="1", **settings)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket, relay: Relay) -> Iterator[Fleet]:  # noqa: ANN001
    """Two hosts that keep at most 10 KiB of sleeping instances' copies: a shipped copy is evicted at once."""
    yield from _fleet("s3down", tmp_path_factory, pg_cluster, seaweedfs, s3_bucket, relay, fleet_cache_mib="0.01")


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket, relay: Relay) -> Iterator[Fleet]:  # noqa: ANN001
    """Two hosts that keep every copy."""
    yield from _fleet("s3roomy", tmp_path_factory, pg_cluster, seaweedfs, s3_bucket, relay, fleet_cache_mib="0")


def test_an_agent_asleep_on_a_live_host_wakes_through_any_host_while_the_store_is_down(roomy: Fleet,
                                                                                       relay: Relay) -> None:
    assert replied(roomy.turn(0, "bob")) == "1: hi"
    put_to_sleep(roomy, "bob")                                       # shipped: any host may wake it
    relay.close()
    try:
        # h2 cannot fetch it: h1, whose disk holds the copy, wakes it (once; later turns go straight there).
        r = roomy.turn(1, "bob")
        assert replied(r) == "2: hi" and r.headers["x-moorage-served-by"] == "h1"
        r = roomy.turn(1, "bob")
        assert replied(r) == "3: hi" and r.headers["x-moorage-served-by"] == "h1"
        assert roomy.records()["bob"].meta["resumed_from"]["from"] == "local"
    finally:
        relay.open()


def test_a_host_drained_while_the_store_is_down_leaves_only_once_its_agents_are_shipped(roomy: Fleet,
                                                                                         relay: Relay) -> None:
    from moorage.config import Config
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    def state() -> str:
        with open_store(Config(store_url=roomy.store_url)) as store:
            return HostRegistry(store.backend).get("h1").state

    assert replied(roomy.turn(0, "eve")) == "1: hi"
    relay.close()
    try:
        assert replied(roomy.turn(0, "eve")) == "2: hi"
        put_to_sleep(roomy, "eve")                                   # unshipped: its newest state is on h1's disk only
        with open_store(Config(store_url=roomy.store_url)) as store:
            HostRegistry(store.backend).set_state("h1", "draining")
        time.sleep(8)
        assert state() == "draining" and roomy.hosts[0].proc.poll() is None  # it waits for the store
    finally:
        relay.open()
    assert roomy.hosts[0].proc.wait(timeout=90) == 0          # shipped, then left cleanly
    assert state() == "gone"
    r = roomy.turn(1, "eve")
    assert replied(r) == "3: hi"                                   # nothing lost


def test_an_agent_no_host_holds_gets_a_clear_error_while_the_store_is_down_and_wakes_after(fleet: Fleet,
                                                                                          relay: Relay) -> None:
    assert replied(fleet.turn(0, "cat")) == "1: hi"
    put_to_sleep(fleet, "cat")
    sid = fleet.records()["cat"].id
    until(lambda: not (fleet.hosts[0].data / "sandboxes" / sid).exists(), "cat's copy evicted", 30)
    relay.close()
    try:
        for via in (0, 1):
            r = fleet.turn(via, "cat")
            assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
            assert "cannot reach the object store" in r.json()["detail"], r.text
    finally:
        relay.open()
    assert replied(fleet.turn(1, "cat")) == "2: hi"              # nothing was lost or half-made meanwhile


def test_an_agent_that_slept_while_the_store_was_down_keeps_its_newest_copy_and_is_shipped_once_it_is_back(
        fleet: Fleet, relay: Relay) -> None:
    assert replied(fleet.turn(0, "ada")) == "1: hi"
    until(lambda: (fleet.records()["ada"].meta.get("shipped") or {}).get("awake"), "ada shipped while awake", 30)
    assert replied(fleet.turn(0, "ada")) == "2: hi"
    relay.close()
    try:
        put_to_sleep(fleet, "ada")                                   # the sleep stands, unshipped
        rec = fleet.records()["ada"]
        assert rec.state == "sleeping" and rec.meta["shipped_current"] is False
        time.sleep(4)                                          # the cache is checked every second (bound 10 KiB)
        assert (fleet.hosts[0].data / "sandboxes" / rec.id).is_dir(), "the only newest copy was evicted"
        r = fleet.turn(1, "ada")                               # through the other host: forwarded to its holder
        assert replied(r) == "3: hi" and r.headers["x-moorage-served-by"] == "h1"
        put_to_sleep(fleet, "ada", via=1)
        assert fleet.records()["ada"].meta["shipped_current"] is False
    finally:
        relay.open()
    # Back: the host ships what slept unshipped, so any host can wake it, even once its holder is gone.
    until(lambda: fleet.records()["ada"].meta.get("shipped_current") is True, "ada shipped after the outage", 60)
    fleet.hosts[0].kill()
    deadline = time.monotonic() + 60
    while (r := fleet.turn(1, "ada")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replied(r) == "4: hi"
    assert fleet.records()["ada"].host == "h2"


def test_chunks_of_a_shipment_the_store_cut_midway_are_deleted_by_a_later_prune_once_old(
        seaweedfs, s3_bucket, relay: Relay, tmp_path: Path) -> None:  # noqa: ANN001
    import os
    import threading

    from moorage.config import Config
    from moorage.fleet.ship import Shipper
    from moorage.objects import ObjectStoreUnavailable, open_object_store

    chunk = 128 * 1024
    settings = seaweedfs.settings(s3_bucket, f"orphans-{tmp_path.name}")
    direct = open_object_store(Config(data_dir=tmp_path / "d1", **settings))
    through = open_object_store(Config(data_dir=tmp_path / "d2", **{
        **settings, "object_store_endpoint": f"http://127.0.0.1:{relay.port}"}))
    prefix = "instances/t/cut"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-notes.txt").write_text("kept across the outage")
    (src / "big.bin").write_bytes(os.urandom(60 * chunk))
    ship = Shipper(through, chunk_bytes=chunk, workers=1)

    def chunks() -> set[str]:
        return {o.key.rsplit("/", 1)[1] for o in direct.iter(f"{prefix}/chunks/")}

    def cut() -> None:  # the store goes down once a few chunks are in
        until(lambda: len(chunks()) >= 3, "the first chunks uploaded", 60, 0.02)
        relay.close()

    cutter = threading.Thread(target=cut)
    cutter.start()
    try:
        with pytest.raises(ObjectStoreUnavailable):
            ship.push(src, prefix, "000001-1", include=lambda rel: True)
    finally:
        cutter.join()
        relay.open()
    orphans = chunks()
    assert len(orphans) >= 3 and not list(direct.iter(f"{prefix}/snapshots/"))

    # The agent's next turn rewrote the big file; the next shipment succeeds and reuses the notes' chunk.
    (src / "big.bin").write_bytes(os.urandom(3 * chunk))
    good = ship.push(src, prefix, "000001-2", include=lambda rel: True)
    named = {d for e in ship.read_manifest(good.key)["entries"] for d in e.get("chunks") or () if d}
    leftovers = orphans - named
    assert leftovers and orphans & named and chunks() == named | leftovers
    # Young leftovers may be a shipment still uploading: kept. Once older than the grace period: deleted.
    assert ship.prune(src, prefix, keep=3) == (0, 0)
    assert chunks() == named | leftovers
    time.sleep(1.5)
    assert ship.prune(src, prefix, keep=3, orphan_grace_s=1) == (0, len(leftovers))
    assert chunks() == named
    dst = tmp_path / "dst"
    Shipper(direct, chunk_bytes=chunk).pull(good.key, prefix, dst)
    assert (dst / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert (dst / "a-notes.txt").read_text() == "kept across the outage"
    ship.close()
