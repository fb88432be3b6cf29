"""PostgreSQL going away in the middle of a sleep or a wake (the instance claimed for it and snapshotted or restored,
the outcome not yet recorded): once PostgreSQL is back the outcome is recorded and the next turn is served at once,
instead of waiting for the claim to time out (two minutes by default)."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from tests.fleet.harness import Fleet, Relay, put_to_sleep, relayed_fleet, replied, until
from tests.outage.conftest import Outages


class HoldingRelay(Relay):
    """A relay to S3 that holds what the host sends while ``held`` is set (a shipment in progress, paused)."""

    def __init__(self, target_port: int) -> None:
        self.held = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()
        super().__init__(target_port)

    def passing(self, data: bytes, upstream: bool) -> None:
        if upstream and self.held.is_set():
            self.holding.set()
            self.release.wait(60)


@pytest.fixture(scope="module")
def relay(seaweedfs) -> Iterator[HoldingRelay]:  # noqa: ANN001
    r = HoldingRelay(seaweedfs.s3_port)
    yield r
    r.release.set()
    r.close()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, outages: Outages, seaweedfs, s3_bucket,  # noqa: ANN001
         relay: HoldingRelay) -> Iterator[Fleet]:
    yield from relayed_fleet(tmp_path_factory.mktemp("pgsleep"), outages.cluster.create_database("pgsleep"), seaweedfs,
                             s3_bucket, relay, n=1, checkpoint_interval_s="600")


def test_a_sleep_cut_by_a_postgresql_outage_is_recorded_once_it_is_back_and_the_next_turn_wakes_it(
        host: Fleet, outages: Outages, relay: HoldingRelay) -> None:
    assert replied(host.turn(0, "ada")) == "1: hi"
    assert replied(host.turn(0, "ada")) == "2: hi"
    until(lambda: host.records()["ada"].meta.get("shipped"), "ada's first shipment", 30)
    sid = host.records()["ada"].id
    # claimed and snapshotted, not recorded yet; the shipment ends while the store is down
    _store_down_as_the_relay_lets_go(host, outages, relay, lambda: host.api[0].post(f"/v1/sandboxes/{sid}/sleep"),
                                     "ada", "suspending")
    until(lambda: host.records()["ada"].state == "sleeping", "the sleep recorded", 15)
    t0 = time.monotonic()
    r = host.api[0].post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}, timeout=20)
    assert replied(r) == "3: hi" and time.monotonic() - t0 < 10


def test_a_wake_cut_by_a_postgresql_outage_is_recorded_once_it_is_back_and_the_next_turn_is_served(
        host: Fleet, outages: Outages, relay: HoldingRelay) -> None:
    assert replied(host.turn(0, "bob")) == "1: hi"
    put_to_sleep(host, "bob")                                      # shipped
    shutil.rmtree(host.hosts[0].data / "sandboxes" / host.records()["bob"].id)  # evicted: it wakes from S3
    relay.holding.clear()
    relay.release.clear()
    _store_down_as_the_relay_lets_go(host, outages, relay, lambda: host.turn(0, "bob"), "bob", "waking")
    until(lambda: host.records()["bob"].state == "running", "the wake recorded", 15)
    t0 = time.monotonic()
    r = host.api[0].post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bob"}, timeout=20)
    assert replied(r) == "2: hi" and time.monotonic() - t0 < 10


def _store_down_as_the_relay_lets_go(host: Fleet, outages: Outages, relay: HoldingRelay, call, user: str,  # noqa: ANN001
                                     state: str) -> None:
    """``call`` runs until the relay holds its S3 transfer, with ``user``'s record in ``state``; PostgreSQL stops,
    the transfer ends, and ``call`` is answered 503 with Retry-After; PostgreSQL starts again."""
    relay.held.set()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call)
        assert relay.holding.wait(30), "the transfer did not start"
        assert host.records()[user].state == state
        outages.stop()
        try:
            relay.held.clear()
            relay.release.set()
            r = pending.result(timeout=60)
            assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        finally:
            outages.start()
