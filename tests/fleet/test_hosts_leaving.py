"""Hosts leaving a fleet (process driver): the checkpoints of a user whose host died, listed through a survivor,
and a fork sent to a host just as it starts to drain.

One fleet for the module, in order: h3 is killed by the first test, h1 drained by the second.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from moorage.config import Config
from moorage.fleet.hosts import HostRegistry
from moorage.store import open_store
from tests.fleet.harness import Fleet, put_to_sleep, replied, until


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("leaving")
    f = Fleet(base, pg_cluster.create_database("leaving"), seaweedfs.settings(s3_bucket, f"fleet-{base.name}"))
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def _listing(f: Fleet, via: int, user: str) -> httpx.Response:
    return f.api[via].get(f"/v1/agents/echo/users/{user}/checkpoints")


def _turns(listing: dict[str, Any]) -> dict[str, str]:
    return {c["summary"]["turn"]["reply"]: c["id"] for c in listing["data"] if c["kind"] == "turn"}


def test_a_sleeping_users_checkpoints_are_listed_restorable_through_a_survivor_after_its_host_died(
        fleet: Fleet) -> None:
    for _ in range(3):
        replied(fleet.turn(2, "orphan"))                            # on h3
    put_to_sleep(fleet, "orphan", via=2)                              # shipped, with its checkpoints
    before = _listing(fleet, 0, "orphan").json()
    assert {c["restorable"] for c in before["data"]} == {True}, before
    fleet.hosts[2].kill()
    # Once h3's lease lapsed (4 s), the survivors answer for it: from what a wake would resume from.
    until(lambda: _listing(fleet, 0, "orphan").status_code == 200, "the listing answered after h3 died", 60)
    for via in (0, 1):
        after = _listing(fleet, via, "orphan").json()
        assert {c["id"]: c["restorable"] for c in after["data"]} == \
            {c["id"]: c["restorable"] for c in before["data"]}, after
    assert fleet.records()["orphan"].host == "h3"                    # listing woke nothing
    # And they are right: the instance wakes on h2 and rolls back to its first turn.
    r = fleet.api[1].post(f"/v1/agents/echo/users/orphan/checkpoints/{_turns(before)['1: hi']}/rollback", json={})
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
    users = [f"fd{i}" for i in range(10)]
    url, body = f"/v1/agents/echo/users/fsrc/checkpoints/{ck}/fork", {"to_users": users}
    got: dict[str, httpx.Response] = {}
    sent = threading.Thread(target=lambda: got.update(r=fleet.api[0].post(url, json=body, timeout=300)))
    sent.start()
    time.sleep(0.3)                                                   # the fork is under way on h1
    _set_state(fleet, "h1", "draining")
    sent.join(300)
    r = got["r"]
    print("the fork sent to h1 as it began to drain answered", r.status_code)
    assert r.status_code in (201, 503), r.text
    if r.status_code == 503:                                          # refused cleanly: a retry lands elsewhere
        assert r.headers.get("retry-after"), r.headers
        r = fleet.api[1].post(url, json=body)
    assert r.status_code == 201, r.text
    assert sorted(f["user"] for f in r.json()["forks"]) == users
    until(lambda: next(h.state for h in fleet.host_rows() if h.id == "h1") == "gone", "h1 drained and gone", 120)
    for u in users:
        assert replied(fleet.turn(1, u)) == "2: hi"
    assert replied(fleet.turn(1, "fsrc")) == "3: hi"
