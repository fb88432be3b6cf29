"""Time travel in a fleet (process driver): checkpoints listed, rolled back to and forked through any host, after
the instance moved hosts, and after its host died.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

from tests.fleet.harness import Fleet, Relay, put_to_sleep, relayed_fleet, replied, until


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket, relay: Relay) -> Iterator[Fleet]:  # noqa: ANN001
    yield from relayed_fleet(tmp_path_factory.mktemp("ttfleet"), pg_cluster.create_database("ttfleet"), seaweedfs,
                             s3_bucket, relay, checkpoint_interval_s="1")


def _listing(f: Fleet, via: int, user: str) -> dict[str, Any]:
    r = f.api[via].get(f"/v1/agents/echo/users/{user}/checkpoints")
    assert r.status_code == 200, r.text
    return r.json()


def _turns(listing: dict[str, Any]) -> dict[str, str]:
    """message of each turn checkpoint -> its id."""
    return {c["summary"]["turn"]["reply"]: c["id"] for c in listing["data"] if c["kind"] == "turn"}


def test_every_host_lists_an_awake_instances_checkpoints_as_its_owner_does(fleet: Fleet) -> None:
    for _ in range(3):
        replied(fleet.turn(0, "lis"))
    views = [_listing(fleet, i, "lis") for i in range(3)]
    owner = {c["id"]: c["restorable"] for c in views[0]["data"]}
    assert set(owner.values()) == {True}, views[0]
    for v in views[1:]:
        assert {c["id"]: c["restorable"] for c in v["data"]} == owner, v
    # Asleep since, then awake on h2: h1's copy is an older one, which must not answer for the instance.
    put_to_sleep(fleet, "lis")
    assert replied(fleet.turn(1, "lis")) == "4: hi"
    views = [_listing(fleet, i, "lis") for i in range(3)]
    assert len(views[1]["data"]) == 4 and {c["restorable"] for c in views[1]["data"]} == {True}, views[1]
    for v in (views[0], views[2]):
        assert {c["id"]: c["restorable"] for c in v["data"]} == {c["id"]: True for c in views[1]["data"]}, v


def test_a_rollback_through_another_host_and_after_the_instance_moved(fleet: Fleet) -> None:
    for _ in range(3):
        replied(fleet.turn(0, "mv"))
    ids = _turns(_listing(fleet, 0, "mv"))
    r = fleet.api[1].post(f"/v1/agents/echo/users/mv/checkpoints/{ids['2: hi']}/rollback", json={})
    assert r.status_code == 200, r.text
    assert replied(fleet.turn(2, "mv")) == "3: hi"
    put_to_sleep(fleet, "mv")
    assert replied(fleet.turn(1, "mv")) == "4: hi"       # woken on h2 from the object store
    assert fleet.records()["mv"].host == "h2"
    listing = _listing(fleet, 0, "mv")
    ids = _turns(listing)
    # a checkpoint taken on h1 rolls back on h2
    r = fleet.api[0].post(f"/v1/agents/echo/users/mv/checkpoints/{ids['1: hi']}/rollback", json={})
    assert r.status_code == 200, r.text
    assert replied(fleet.turn(0, "mv")) == "2: hi"
    # the abandoned branch's tip (taken on h2) is listed and restorable from h1
    listing = _listing(fleet, 0, "mv")
    tips = [b["tip"] for b in listing["branches"] if not b["current"]]
    assert tips
    r = fleet.api[2].post(f"/v1/agents/echo/users/mv/checkpoints/{tips[-1]}/rollback", json={})
    assert r.status_code == 200, r.text


def test_a_fan_out_fork_of_an_instance_asleep_on_another_host(fleet: Fleet) -> None:
    for _ in range(2):
        replied(fleet.turn(0, "src"))
    put_to_sleep(fleet, "src")
    ids = _turns(_listing(fleet, 2, "src"))
    r = fleet.api[2].post(f"/v1/agents/echo/users/src/checkpoints/{ids['1: hi']}/fork",
                          json={"to_users": ["f1", "f2", "f3"]})
    assert r.status_code == 201, r.text
    for i, u in enumerate(("f1", "f2", "f3")):
        assert replied(fleet.turn(i, u)) == "2: hi"
    assert replied(fleet.turn(1, "src")) == "3: hi"


def test_a_checkpoint_older_than_the_snapshots_kept_still_rolls_back_on_another_host(fleet: Fleet, seaweedfs,  # noqa: ANN001
                                                                                      s3_bucket) -> None:
    """The bucket keeps an instance's newest 3 snapshots; each holds the checkpoints the instance keeps, so a
    checkpoint from before the oldest kept snapshot is still restorable wherever the instance wakes."""
    for i in range(5):                                        # five sleeps, each woken on the next host
        assert replied(fleet.turn(i % 3, "old")) == f"{i + 1}: hi"
        put_to_sleep(fleet, "old", via=i % 3)
    rec = fleet.records()["old"]
    prefix = fleet.env["MOORAGE_OBJECT_STORE_URL"].split("/", 3)[3]
    listed = seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/")["Contents"]
    assert len([o for o in listed if f"/{rec.id}/snapshots/" in o["Key"]]) == 3
    first = _turns(_listing(fleet, 1, "old"))["1: hi"]
    r = fleet.api[2].post(f"/v1/agents/echo/users/old/checkpoints/{first}/rollback", json={})
    assert r.status_code == 200, r.text
    assert replied(fleet.turn(1, "old")) == "2: hi"


def test_forgetting_a_user_through_another_host_removes_its_copies_and_checkpoints_from_every_disk(
        fleet: Fleet) -> None:
    assert replied(fleet.turn(0, "ghost")) == "1: hi"
    put_to_sleep(fleet, "ghost")                                    # shipped; h1 keeps its copy
    assert replied(fleet.turn(1, "ghost")) == "2: hi"             # woken on h2 from the object store
    put_to_sleep(fleet, "ghost", via=1)
    sid = fleet.records()["ghost"].id
    copies = [h.data / "sandboxes" / sid for h in fleet.hosts[:2]]
    assert all((c / "checkpoints").is_dir() for c in copies)
    r = fleet.api[2].delete("/v1/agents/echo/users/ghost")
    assert r.status_code in (200, 204), r.text
    until(lambda: not any(c.exists() for c in copies), "the forgotten user's copies gone from h1 and h2", 60)


def _after_takeover(f: Fleet, via: int, user: str) -> httpx.Response:
    """A turn through host ``via`` once the dead host's lease lapsed (the lease is 4 s)."""
    deadline = time.monotonic() + 60
    while (r := f.turn(via, user)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    return r


def _intend_rollback(f: Fleet, user: str, to: str) -> None:
    """What a host killed in the middle of a rollback leaves in the store: the intent, the store not rolled back."""
    from moorage.config import Config
    from moorage.store import open_store
    from moorage.store.repos.checkpoints import Checkpoints

    with open_store(Config(store_url=f.store_url)) as store:
        (ts,) = list(store.operator.tenants())
        Checkpoints(ts).set_pending("echo", user, {"op": "rollback", "to": to})


def test_after_its_host_died_a_users_checkpoints_roll_back_on_a_survivor(fleet: Fleet, relay: Relay) -> None:
    """h1 dies in the middle of a rollback: the host that takes the instance over finishes it before any turn, as a
    restarted host would; checkpoints shipped with the instance stay restorable. Then h2 dies in the middle of a
    rollback to a checkpoint it never shipped (the object store was down): h3 drops that intent (the instance is
    at the old point), a rollback to that checkpoint is refused clearly, and time travel goes on. Last: it kills."""
    for _ in range(3):
        replied(fleet.turn(0, "dead"))
    until(lambda: (fleet.records()["dead"].meta.get("shipped") or {}).get("awake"), "shipped while awake", 30)
    time.sleep(3)  # the shipment after the third turn (coalesced: at most one every 2 s)
    ids = _turns(_listing(fleet, 0, "dead"))
    _intend_rollback(fleet, "dead", ids["1: hi"])
    fleet.hosts[0].kill()
    assert replied(_after_takeover(fleet, 1, "dead")) == "2: hi"  # the rollback to turn 1 finished first
    rec = fleet.records()["dead"]
    assert rec.host == "h2" and rec.meta["resumed_from"]["from"] == "shipped"
    r = fleet.api[2].post("/v1/agents/echo/users/dead/checkpoints", json={"name": "later"})
    assert r.status_code == 201, r.text
    assert replied(fleet.turn(2, "dead")) == "3: hi"              # nothing is rolled back again later
    listing = _listing(fleet, 2, "dead")
    assert {c["restorable"] for c in listing["data"] if c["kind"] != "missing"} == {True}, listing
    r = fleet.api[2].post(f"/v1/agents/echo/users/dead/checkpoints/{ids['3: hi']}/rollback", json={})
    assert r.status_code == 200, r.text
    assert replied(fleet.turn(1, "dead")) == "4: hi"
    time.sleep(3)                                             # shipped at 4
    relay.close()
    try:
        assert replied(fleet.turn(1, "dead")) == "5: hi"          # its checkpoint is on h2's disk only
        five = _turns(_listing(fleet, 1, "dead"))["5: hi"]
        _intend_rollback(fleet, "dead", five)
        fleet.hosts[1].kill()
    finally:
        relay.open()
    assert replied(_after_takeover(fleet, 2, "dead")) == "5: hi"  # from the copy shipped at 4; the intent dropped
    r = fleet.api[2].post(f"/v1/agents/echo/users/dead/checkpoints/{five}/rollback", json={})
    assert r.status_code == 409 and r.json()["type"].endswith("checkpoint-gone"), r.text
    assert "before shipping it" in r.json()["detail"], r.text
    r = fleet.api[2].post("/v1/agents/echo/users/dead/checkpoints", json={"name": "after"})
    assert r.status_code == 201, r.text
    assert replied(fleet.turn(2, "dead")) == "6: hi"
