"""A takeover wake cut by a PostgreSQL outage (the instance's old host died in the middle of a rollback; the
survivor restored the instance, then could not record it): once PostgreSQL is back the wake is recorded and the
rollback its old host left half done is finished before any turn, as an uncut takeover would."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from tests.fleet.harness import Fleet, relayed_fleet, replied, until
from tests.fleet.test_timetravel_fleet import _intend_rollback, _listing, _turns
from tests.outage.conftest import Outages
from tests.outage.test_postgres_sleep import HoldingRelay, _store_down_as_the_relay_lets_go
from tests.outage.test_postgres_sleep import relay  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, outages: Outages, seaweedfs, s3_bucket,  # noqa: ANN001
          relay: HoldingRelay) -> Iterator[Fleet]:  # noqa: F811
    yield from relayed_fleet(tmp_path_factory.mktemp("pgtakeover"), outages.cluster.create_database("pgtakeover"),
                             seaweedfs, s3_bucket, relay, n=2, checkpoint_interval_s="1")


def test_a_takeover_wake_recorded_after_an_outage_finishes_the_dead_hosts_rollback_first(
        fleet: Fleet, outages: Outages, relay: HoldingRelay) -> None:  # noqa: F811
    for _ in range(3):
        replied(fleet.turn(0, "dan"))
    until(lambda: (fleet.records()["dan"].meta.get("shipped") or {}).get("awake"), "shipped while awake", 30)
    time.sleep(3)  # the shipment after the third turn (coalesced: at most one every 2 s)
    ids = _turns(_listing(fleet, 0, "dan"))
    _intend_rollback(fleet, "dan", ids["1: hi"])  # h1 dies in the middle of a rollback to turn 1
    fleet.hosts[0].kill()
    time.sleep(6)  # its lease (4 s) lapses: h2 takes the instance over on the next turn
    relay.holding.clear()
    relay.release.clear()
    # h2 restores it from S3; PostgreSQL stops before the wake is recorded: that turn is answered 503
    _store_down_as_the_relay_lets_go(fleet, outages, relay, lambda: fleet.turn(1, "dan"), "dan", "waking")
    until(lambda: fleet.records()["dan"].state == "running", "the wake recorded", 20)
    assert fleet.records()["dan"].host == "h2"
    assert replied(fleet.turn(1, "dan")) == "2: hi"  # the rollback to turn 1 was finished first
    assert replied(fleet.turn(1, "dan")) == "3: hi"
