"""A serving `moorage up` host whose S3 server goes away (a relay in front of the real SeaweedFS closes) while its
users sleep, wake, start and ship snapshots: they are served from this host's disk meanwhile, and once S3 is back
every snapshot the outage held back is shipped without a restart, so none lives only on this host's disk."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from tests.fleet.harness import Fleet, Relay, put_to_sleep, relayed_fleet, replied, until


@pytest.fixture(scope="module")
def relay(seaweedfs) -> Iterator[Relay]:  # noqa: ANN001
    r = Relay(seaweedfs.s3_port)
    yield r
    r.close()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket, relay: Relay) -> Iterator[Fleet]:  # noqa: ANN001
    yield from relayed_fleet(tmp_path_factory.mktemp("s3host"), pg_cluster.create_database("s3host"), seaweedfs,
                             s3_bucket, relay, n=1, checkpoint_interval_s="1")


def _shipped_at(f: Fleet, user: str) -> float:
    return float((f.records()[user].meta.get("shipped") or {}).get("at") or 0)


def test_users_sleep_wake_and_start_while_s3_is_down_and_every_snapshot_is_shipped_once_it_is_back(
        host: Fleet, relay: Relay) -> None:
    for user in ("ada", "bob", "cat"):
        assert replied(host.turn(0, user)) == "1: hi"
    put_to_sleep(host, "bob")
    until(lambda: all(_shipped_at(host, u) for u in ("ada", "bob", "cat")), "every instance shipped once", 30)
    relay.close()
    try:
        assert replied(host.turn(0, "ada")) == "2: hi"
        put_to_sleep(host, "ada")                                  # stands, unshipped
        assert replied(host.turn(0, "bob")) == "2: hi"             # wakes from this host's disk
        assert replied(host.turn(0, "dan")) == "1: hi"             # a new user: from the template on this disk
        assert replied(host.turn(0, "cat")) == "2: hi"
        put_to_sleep(host, "cat")
        recs = host.records()
        assert recs["ada"].meta["shipped_current"] is False and recs["cat"].meta["shipped_current"] is False
        time.sleep(3)                                              # the host tries (and fails) every second
    finally:
        relay.open()
    back = time.time()
    until(lambda: all(host.records()[u].meta.get("shipped_current") for u in ("ada", "cat")),
          "what slept during the outage shipped", 30)
    until(lambda: all(_shipped_at(host, u) > back for u in ("bob", "dan")), "awake instances shipped again", 30)
    for user, n in (("ada", 3), ("bob", 3), ("cat", 3), ("dan", 2)):
        assert replied(host.turn(0, user)) == f"{n}: hi"           # nothing lost


def test_shipments_refused_during_an_s3_outage_are_a_line_each_kind_not_one_per_instance_and_pass(
        host: Fleet, relay: Relay) -> None:
    """Two instances asleep unshipped and two awake ones, with the host trying every second: the log says once
    that shipping fails (and would again each minute), then that it works again, not once per instance per pass."""
    for user in ("eve", "fay", "gil", "hal"):
        assert replied(host.turn(0, user)) == "1: hi"
    until(lambda: all(_shipped_at(host, u) for u in ("eve", "fay", "gil", "hal")), "every instance shipped once", 30)
    mark = host.hosts[0].log.stat().st_size
    relay.close()
    try:
        for user in ("gil", "hal"):
            put_to_sleep(host, user)                               # stand unshipped
        for user in ("eve", "fay"):
            assert replied(host.turn(0, user)) == "2: hi"          # awake, changed: shipped every second
        time.sleep(8)                                              # eight passes, each refused for each instance
    finally:
        relay.open()
    until(lambda: all(host.records()[u].meta.get("shipped_current") for u in ("gil", "hal")),
          "what slept during the outage shipped", 30)

    def text() -> str:
        return host.hosts[0].log.read_bytes()[mark:].decode(errors="replace")

    until(lambda: "shipping an awake instance works again" in text(), "the awake shipments say they work again", 30)
    log = text()
    assert log.count("shipping sleeping instances failed") == 1, log
    assert "shipping sleeping instances works again" in log, log
    # Once: not once per instance per pass (16 lines here before), nor again after a shipment begun before the
    # outage returned once another's had failed (that said "works again").
    assert log.count("shipping an awake instance failed") == 1, log
    assert "a sleeping instance's snapshot still could not be shipped" not in log, log


def test_a_pass_with_nothing_to_ship_during_an_s3_outage_does_not_end_its_failed_rounds(
        host: Fleet, relay: Relay) -> None:
    """An instance asleep unshipped is woken during the outage: the next pass has nothing to ship, and it counted
    as one that worked ("works again", though nothing reached S3), so once the instance slept again the next
    refusal said "failed" a second time within the minute."""
    assert replied(host.turn(0, "ivy")) == "1: hi"
    until(lambda: _shipped_at(host, "ivy"), "ivy shipped once", 30)
    mark = host.hosts[0].log.stat().st_size

    def text() -> str:
        return host.hosts[0].log.read_bytes()[mark:].decode(errors="replace")

    relay.close()
    try:
        put_to_sleep(host, "ivy")                                  # stands unshipped
        until(lambda: "shipping sleeping instances failed" in text(), "a pass refused", 30)
        assert replied(host.turn(0, "ivy")) == "2: hi"             # awake: the passes have nothing to ship
        time.sleep(3)
        put_to_sleep(host, "ivy")                                  # unshipped again: the passes try it again
        time.sleep(3)
        during = text()
    finally:
        relay.open()
    until(lambda: host.records()["ivy"].meta.get("shipped_current"), "ivy shipped once S3 is back", 90)
    assert during.count("shipping sleeping instances failed") == 1, during
    assert "shipping sleeping instances works again" not in during, during
    until(lambda: "shipping sleeping instances works again" in text(), "the shipments say they work again", 30)
