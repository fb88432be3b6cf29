"""Hosts leaving a fleet (process driver): the checkpoints of a user whose host died, listed through a survivor,
and a fork sent to a host just as it starts to drain.

One fleet for the module, in order: h3 is killed by the first test, h1 drained by the second.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from moorage.config import Config
from moorage.fleet.hosts import HostRegistry
from moorage.store import open_store
from tests.fleet.harness import Fleet, Relay, put_to_sleep, relayed_fleet, replied, until


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket, relay: Relay) -> Iterator[Fleet]:  # noqa: ANN001
    yield from relayed_fleet(tmp_path_factory.mktemp("leaving"), pg_cluster.create_database("leaving"), seaweedfs,
                             s3_bucket, relay)


def _listing(f: Fleet, via: int, user: str) -> httpx.Response:
    return f.api[via].get(f"/v1/agents/echo/users/{user}/checkpoints")


def _turns(listing: dict[str, Any]) -> dict[str, str]:
    return {c["summary"]["turn"]["reply"]: c["id"] for c in listing["data"] if c["kind"] == "turn"}


def test_a_users_checkpoints_are_listed_through_a_survivor_after_its_host_died_as_a_wake_would_find_them(
        fleet: Fleet, relay: Relay) -> None:
    for _ in range(3):
        replied(fleet.turn(2, "orphan"))                            # on h3
    put_to_sleep(fleet, "orphan", via=2)                              # shipped, with its checkpoints
    before = _listing(fleet, 0, "orphan").json()
    assert {c["restorable"] for c in before["data"]} == {True}, before
    relay.close()                                                     # the object store unreachable
    try:
        assert replied(fleet.turn(2, "orphan")) == "4: hi"         # its checkpoint is on h3's disk only
        fourth = _turns(_listing(fleet, 2, "orphan").json())["4: hi"]  # (a listing waits for it)
        fleet.hosts[2].kill()
    finally:
        relay.open()
    # Once h3's lease lapsed (4 s), the survivors answer for it: from what a wake resumes from.
    until(lambda: _listing(fleet, 0, "orphan").status_code == 200, "the listing answered after h3 died", 60)
    want = {**{c["id"]: True for c in before["data"]}, fourth: False}
    for via in (0, 1):
        after = _listing(fleet, via, "orphan").json()
        assert {c["id"]: c["restorable"] for c in after["data"]} == want, after
    assert fleet.records()["orphan"].host == "h3"                    # listing woke nothing
    # And they are right: the instance wakes on h2 at its third turn, the fourth's checkpoint is gone, the
    # first's rolls back.
    turns = _turns(before)
    r = fleet.api[1].post(f"/v1/agents/echo/users/orphan/checkpoints/{fourth}/rollback", json={})
    assert r.status_code == 409 and r.json()["type"].endswith("checkpoint-gone"), r.text
    r = fleet.api[1].post(f"/v1/agents/echo/users/orphan/checkpoints/{turns['1: hi']}/rollback", json={})
    assert r.status_code == 200, r.text
    assert replied(fleet.turn(0, "orphan")) == "2: hi"


def _set_state(f: Fleet, host: str, state: str) -> None:
    with open_store(Config(store_url=f.store_url)) as store:
        HostRegistry(store.backend).set_state(host, state)


def test_a_fork_sent_to_a_host_as_it_starts_to_drain_is_finished_or_refused_before_anything_is_written(
        fleet: Fleet) -> None:
    for _ in range(2):
        replied(fleet.turn(0, "fsrc"))                              # awake on h1
    ck = _turns(_listing(fleet, 0, "fsrc").json())["1: hi"]
    url = f"/v1/agents/echo/users/fsrc/checkpoints/{ck}/fork"
    first, second = [f"fd{i}" for i in range(10)], ["fe0", "fe1"]
    got: dict[str, Any] = {}

    def send(name: str, call: Callable[[], httpx.Response]) -> threading.Thread:
        t = threading.Thread(target=lambda: got.update({name: call()}))
        t.start()
        return t

    # A slow turn keeps h1 up (draining) for 4 s; a fork is under way on h1 when the drain starts.
    hold = send("hold", lambda: fleet.turn(0, "hold", "slow"))
    time.sleep(0.1)
    forking = send("first", lambda: fleet.api[0].post(url, json={"to_users": first}, timeout=300))
    time.sleep(0.3)
    _set_state(fleet, "h1", "draining")
    time.sleep(1.7)                                                   # h1 noticed (it heartbeats every 1 s)
    try:                                                              # a fork sent now is not begun there
        got["second"] = fleet.api[0].post(url, json={"to_users": second}, timeout=300)
    except httpx.TransportError as e:                                 # h1 already left: the balancer moves on
        got["second"] = e
    forking.join(300)
    hold.join(60)
    for name, users in (("first", first), ("second", second)):
        r = got[name]
        if isinstance(r, httpx.Response):
            assert r.status_code in (201, 503), r.text
        if not isinstance(r, httpx.Response) or r.status_code == 503:  # refused cleanly: a retry lands elsewhere
            assert not isinstance(r, httpx.Response) or r.headers.get("retry-after"), r.headers
            r = fleet.api[1].post(url, json={"to_users": users})
        assert r.status_code == 201, r.text
        assert sorted(f["user"] for f in r.json()["forks"]) == users
    assert replied(got["hold"]) == "1: slow"
    until(lambda: next(h.state for h in fleet.host_rows() if h.id == "h1") == "gone", "h1 drained and gone", 120)
    for u in first + second:
        assert replied(fleet.turn(1, u)) == "2: hi"
    assert replied(fleet.turn(1, "fsrc")) == "3: hi"
