"""Two `moorage up` hosts on one PostgreSQL (real, stopped with pg_ctl) and one S3 server: when PostgreSQL was down
longer than the lease, every host's heartbeat is old, and the first host back must not take that for its peers
being dead (taking their awake instances over from their last shipped snapshot would lose what came after)."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from tests.fleet.harness import Fleet, replied
from tests.outage.conftest import Outages


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, outages: Outages, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("pgfleet")
    # Awake instances are shipped rarely: what a host's disk holds past its last shipment is only there.
    f = Fleet(base, outages.cluster.create_database("pgfleet"), seaweedfs.settings(s3_bucket, f"outage-{base.name}"),
              n=2, checkpoint_interval_s="600")
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def test_after_postgresql_was_down_longer_than_the_lease_no_host_takes_over_its_peers_awake_instances(
        fleet: Fleet, outages: Outages) -> None:
    for n in range(1, 5):
        assert replied(fleet.turn(0, "ada")) == f"{n}: hi"       # awake on h1, shipped after its first turn only
    assert replied(fleet.turn(1, "bob")) == "1: hi"              # awake on h2
    outages.stop()
    try:
        time.sleep(6)                                              # longer than the 4 s lease
    finally:
        outages.start()
    # At once through the other host: both hosts' heartbeats are 6 s old, and neither is dead.
    assert replied(fleet.turn(1, "ada")) == "5: hi"              # not "2: hi" from its shipped snapshot
    assert replied(fleet.turn(0, "bob")) == "2: hi"
    time.sleep(6)                                                  # both beat again
    assert replied(fleet.turn(1, "ada")) == "6: hi"
    recs = fleet.records()
    assert (recs["ada"].host, recs["ada"].lease_epoch, recs["bob"].host) == ("h1", 0, "h2")
