"""Hosts leaving a fleet (process driver): a fork sent to a host just as it starts to drain.

One fleet for the module; h1 is drained by the last test.
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
from tests.fleet.harness import Fleet, replied, until


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
