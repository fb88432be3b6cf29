"""Forgetting a user (DELETE /v1/agents/{agent}/users/{user}) through a host that does not hold their instance.

* Awake on another host with a turn in flight: the forget is forwarded to that host, which cancels the turn and
  destroys the sandbox; nothing of the user is left there or in the bucket.
* Asleep on another host (shipped): the forgetting host deleted its snapshots and rows while the host that had
  slept it woke it again for a turn sent there meanwhile; that host then kept the user's sandbox running after the
  forget returned, and shipped it into the bucket again. Now the forgetting host first marks the instance deleted
  on itself, so such a turn is forwarded to it, waits behind the forget and is refused.
* Its holder dead: the forget succeeds through a survivor and the bucket holds nothing of the user; sent while the
  holder is frozen but its lease still holds, it is forwarded there, given up once the lease lapses, and served by
  the survivor.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from moorage.config import Config
from moorage.store import open_store
from tests.fleet.harness import Fleet, Relay, put_to_sleep, replied, until

pytestmark = pytest.mark.timeout(600)

LEASE_TTL_S = 4.0  # the harness's


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}")


class SlowRelay(Relay):
    """The harness's relay in front of the S3 server, holding each request naming ``needle`` that is not a read (a
    deletion's) for ``delay_s``, and saying that it saw one: one host's deletion of one instance's objects is slow."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self.needle: bytes | None = None
        self.seen = threading.Event()
        super().__init__(target_port)

    def passing(self, data: bytes, upstream: bool) -> None:
        if upstream and self.needle is not None and self.needle in data and not data.startswith((b"GET ", b"HEAD ")):
            self.seen.set()
            time.sleep(self.delay_s)


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, s3: dict[str, str], seaweedfs) -> Iterator[tuple[Fleet, SlowRelay]]:  # noqa: ANN001
    relay = SlowRelay(seaweedfs.s3_port, delay_s=4.0)
    f = Fleet(tmp_path, pg_url, s3, n=2)
    try:
        f.deploy()
        # h3 reaches the object store through the relay; it fetches no template ahead (no request of its own
        # for the relay to hold while the test waits for the forget's).
        f.add_host(object_store_endpoint=f"http://127.0.0.1:{relay.port}", template_prefetch="0")
        yield f, relay
    finally:
        f.close()
        relay.close()


def _objects_of(seaweedfs, s3_bucket: str, s3: dict[str, str], sid: str) -> list[str]:  # noqa: ANN001
    prefix = s3["object_store_url"].split("/", 3)[3]
    listed = seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/").get("Contents", [])
    return [o["Key"] for o in listed if f"/{sid}/" in o["Key"]]


def test_a_forget_through_another_host_ends_the_turn_running_on_the_holder(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f, _ = fleet
    assert replied(f.turn(0, "ada")) == "1: hi"
    rec = f.records()["ada"]
    assert rec.host == "h1"
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(f.turn, 0, "ada", "slow")  # 4 s on h1
        until(lambda: _running(f, "ada"), "the slow turn runs", timeout_s=30, every_s=0.1)
        until(lambda: _awake_on(f, "h1") == 1, "h1 says it holds ada awake", timeout_s=10, every_s=0.2)
        r = f.api[1].delete("/v1/agents/echo/users/ada")
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert r.headers.get("x-moorage-served-by") == "h1"  # the holder forgot them
        turn = slow.result(timeout=60)
    assert turn.status_code == 409, turn.text  # cancelled: what it would reply is forgotten
    until(lambda: _awake_on(f, "h1") == 0, "h1 holds nothing awake", timeout_s=10, every_s=0.2)
    assert "ada" not in f.records()
    assert f.api[0].get("/v1/agents/echo/users/ada").status_code == 404
    time.sleep(3)  # a shipment after the turn would have reached the bucket by now
    assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []


def _awake_on(f: Fleet, host: str) -> int:
    """The instances ``host`` holds awake, as its last heartbeat said."""
    return int(next(h for h in f.host_rows() if h.id == host).load.get("awake", 0))


def _running(f: Fleet, user: str) -> bool:
    """Whether a turn of ``user`` is running (its durable run)."""
    store = open_store(Config(store_url=f.store_url))
    try:
        return any(r.scope.user == user for ts in store.operator.tenants()
                   for r in ts.runs.list(status=["running"], agent="echo"))
    finally:
        store.close()


def test_a_turn_on_the_host_that_slept_the_instance_during_a_forget_elsewhere_waits_and_leaves_nothing(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f, relay = fleet
    assert replied(f.turn(0, "bea")) == "1: hi"
    put_to_sleep(f, "bea")  # shipped: any host may wake it; h1 keeps its copy and wakes it from there
    rec = f.records()["bea"]
    assert rec.state == "sleeping" and rec.host == "h1" and _objects_of(seaweedfs, s3_bucket, s3, rec.id)
    relay.needle = rec.id.encode()  # h3's deletion of bea's objects (the forget's) takes 4 s
    with ThreadPoolExecutor(2) as pool:
        forgot = pool.submit(f.api[2].delete, "/v1/agents/echo/users/bea")
        assert relay.seen.wait(60), "the forget never reached the object store"
        turn = f.turn(0, "bea", "again")  # on h1, while h3 deletes bea's snapshots
        r = forgot.result(timeout=120)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    # The turn waited for the forget (on h3, where the instance was being deleted) and found its user gone.
    assert turn.status_code == 409 and "forgotten" in turn.json()["detail"], turn.text
    time.sleep(4)  # a shipment of a sandbox woken meanwhile would have reached the bucket by now
    until(lambda: _awake_on(f, "h1") == 0, "h1 holds nothing awake", timeout_s=10, every_s=0.2)
    assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    assert "bea" not in f.records()
    assert f.api[0].get("/v1/agents/echo/users/bea").status_code == 404


def test_a_forget_whose_instance_is_on_a_dead_host_removes_it_from_the_bucket(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f, _ = fleet
    assert replied(f.turn(1, "cy")) == "1: hi"
    put_to_sleep(f, "cy", via=1)
    assert replied(f.turn(1, "cy")) == "2: hi"  # awake on h2 again, its sleep shipped
    rec = f.records()["cy"]
    assert rec.host == "h2" and rec.state == "running" and _objects_of(seaweedfs, s3_bucket, s3, rec.id)
    f.hosts[1].kill()
    # Before its lease lapses the holder is still taken as alive: the forward fails and says to retry.
    deadline = time.monotonic() + 60
    while True:
        r = f.api[0].delete("/v1/agents/echo/users/cy")
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    assert "cy" not in f.records()
    assert f.api[0].get("/v1/agents/echo/users/cy").status_code == 404
    # A new user of the same name starts afresh on a survivor.
    assert replied(f.turn(0, "cy")) == "1: hi"


def test_a_forget_of_a_user_with_sessions_asleep_here_and_awake_elsewhere_goes_to_the_holder(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    from moorage.cli.up import tar_dir
    from moorage.devservices.fleet import write_counter_agent

    f, _ = fleet
    d = write_counter_agent(f.base / "sess", name="sess")
    (d / "moorage.toml").write_text('[agent]\nname = "sess"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nscope = "session"\nusers = "auto"\nsleep = "fixed:3600"\n')
    r = f.api[0].post("/v1/agents/sess/deployments", content=tar_dir(d), headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text

    def turn(i: int, session: str) -> None:
        r = f.api[i].post("/v1/agents/sess/invoke", json={"message": "hi", "user": "dee", "session": session})
        assert r.status_code == 200, r.text

    turn(0, "one")
    sid_one = next(r.id for r in _records(f) if r.scope.ref == "one")
    assert f.api[0].post(f"/v1/sandboxes/{sid_one}/sleep").json()["slept"] is True  # asleep, shipped
    turn(1, "two")  # awake on h2
    recs = {r.scope.ref: r for r in _records(f)}
    assert recs["one"].state == "sleeping" and recs["two"].host == "h2" and recs["two"].state == "running"
    until(lambda: _awake_on(f, "h2") == 1, "h2 says it holds a session awake", timeout_s=10, every_s=0.2)
    r = f.api[0].delete("/v1/agents/sess/users/dee")  # through h1, which slept the first session
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert r.headers.get("x-moorage-served-by") == "h2"  # forwarded before h1 changed anything
    assert _records(f) == []
    for rec in recs.values():
        assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    until(lambda: _awake_on(f, "h2") == 0, "h2 holds nothing awake", timeout_s=10, every_s=0.2)


def _records(f: Fleet) -> list:
    store = open_store(Config(store_url=f.store_url))
    try:
        return [r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=10000) if r.scope.agent == "sess"]
    finally:
        store.close()


@pytest.mark.parametrize("sent_after_s", [LEASE_TTL_S + 1.5, 0.0], ids=["past-its-lease", "before-it-lapses"])
def test_a_forget_while_the_holder_is_cut_off_past_its_lease_leaves_nothing_when_it_comes_back(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str],  # noqa: ANN001
        sent_after_s: float) -> None:
    """Sent past the holder's lease, the forget is served by h1 at once; sent before it lapses, h1 forwards it to
    the frozen holder, gives up on it once its lease lapses, and serves it itself."""
    f, _ = fleet
    assert replied(f.turn(1, "eve")) == "1: hi"
    rec = f.records()["eve"]
    assert rec.host == "h2"
    h2 = f.hosts[1]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(f.turn, 1, "eve", "slow")  # 4 s in the agent on h2
        until(lambda: _running(f, "eve"), "the slow turn runs", timeout_s=30, every_s=0.1)
        os.killpg(h2.proc.pid, signal.SIGSTOP)  # h2 is cut off (its sandbox runs on)
        try:
            time.sleep(sent_after_s)
            t0 = time.monotonic()
            r = f.api[0].delete("/v1/agents/echo/users/eve")  # its record says running on h2
            waited = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["deleted"] is True, r.text
            assert "x-moorage-served-by" not in r.headers  # h1 served it, not the frozen h2
            assert waited < 60, waited  # at most until h2's lease lapsed, not the forward's read timeout
        finally:
            os.killpg(h2.proc.pid, signal.SIGCONT)
        turn = slow.result(timeout=60)
    # h2's turn finished in its copy, but the record it woke is gone: nothing of it is written, and h2 stops it.
    assert turn.status_code == 409, turn.text
    until(lambda: _awake_on(f, "h2") == 0, "h2 stopped its copy", timeout_s=20, every_s=0.2)
    time.sleep(3)  # a shipment of h2's copy would have reached the bucket by now
    assert _objects_of(seaweedfs, s3_bucket, s3, rec.id) == []
    assert "eve" not in f.records()
    assert f.api[0].get("/v1/agents/echo/users/eve").status_code == 404
    store = open_store(Config(store_url=f.store_url))
    try:
        assert [r for ts in store.operator.tenants() for r in ts.runs.list(limit=10000) if r.scope.user == "eve"] == []
    finally:
        store.close()


def test_a_forget_while_the_object_store_is_down_changes_nothing_and_succeeds_once_it_is_back(
        fleet: tuple[Fleet, SlowRelay], seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f, relay = fleet
    assert replied(f.turn(0, "fay")) == "1: hi"
    put_to_sleep(f, "fay")
    sid = f.records()["fay"].id
    relay.close()  # the object store is down for h3
    try:
        r = f.api[2].delete("/v1/agents/echo/users/fay")
        assert r.status_code == 503, r.text
        assert f.records()["fay"].state == "sleeping"  # nothing changed: the user carries on through any host
        assert replied(f.turn(1, "fay")) == "2: hi"
        put_to_sleep(f, "fay", via=1)
    finally:
        relay.open()
    r = f.api[2].delete("/v1/agents/echo/users/fay")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert _objects_of(seaweedfs, s3_bucket, s3, sid) == []
    assert "fay" not in f.records()


def test_provisioning_a_user_awake_on_another_host_is_served_there(fleet: tuple[Fleet, SlowRelay]) -> None:
    f, _ = fleet
    assert replied(f.turn(0, "gus")) == "1: hi"  # awake on h1
    r = f.api[1].put("/v1/agents/echo/users/gus?provision=true", json={"metadata": {"plan": "pro"}})
    assert r.status_code == 200, r.text
    assert r.headers.get("x-moorage-served-by") == "h1"  # h1 holds it: h2 neither woke a second copy nor forked one
    assert r.json()["metadata"] == {"plan": "pro"} and r.json()["instance"]["state"] == "sleeping"
    rec = f.records()["gus"]
    assert rec.host == "h1" and rec.state == "sleeping"
    assert replied(f.turn(1, "gus")) == "2: hi"  # the same disk, wherever it wakes
