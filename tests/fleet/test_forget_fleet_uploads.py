"""A shipment under way while its user is forgotten elsewhere leaves nothing in the object store.

The user's host is cut off (SIGSTOP) in the middle of shipping their awake instance, past its lease; a survivor
forgets the user (it deletes the instance's objects). When the host comes back its shipment went on: the chunks it
had yet to send and the snapshot's manifest were written after the forget, and stayed in the bucket for good (the
collection only ever looked at templates). Now the host reads the instance's record before it publishes a snapshot:
the record is gone, so it writes no manifest and removes what it had sent.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.fleet.harness import Fleet, replied, until
from tests.fleet.test_forget_fleet import LEASE_TTL_S, SlowRelay, _objects_of, fleet, s3  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def test_a_host_cut_off_mid_shipment_while_its_user_is_forgotten_leaves_nothing_in_the_bucket(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001, F811
    f, relay = fleet
    assert replied(f.turn(2, "ivy")) == "1: hi"  # awake on h3, which reaches the bucket through the relay
    rec = f.records()["ivy"]
    assert rec.host == "h3"
    until(lambda: isinstance(f.records()["ivy"].meta.get("shipped"), dict), "h3 shipped ivy's awake instance",
          timeout_s=30, every_s=0.2)
    # h3's next shipment of ivy (after this turn) is held at its first write: h3 is cut off right then.
    relay.delay_s, relay.needle = 2.0, rec.id.encode()
    relay.seen.clear()
    assert replied(f.turn(2, "ivy")) == "2: hi"
    h3 = f.hosts[2]
    assert relay.seen.wait(30), "h3 never shipped ivy again"
    os.killpg(h3.proc.pid, signal.SIGSTOP)
    try:
        relay.needle = None  # what h3 sends once it is back goes straight through
        time.sleep(LEASE_TTL_S + 1.5)
        r = f.api[0].delete("/v1/agents/echo/users/ivy")  # its record says running on h3, whose lease lapsed
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    finally:
        os.killpg(h3.proc.pid, signal.SIGCONT)
    # h3 finishes its shipment; what it writes of it must not stay.
    time.sleep(5)
    until(lambda: _objects_of(seaweedfs, s3_bucket, s3, rec.id) == [], "the bucket holds nothing of ivy",
          timeout_s=10, every_s=0.5)
    assert "ivy" not in f.records()
