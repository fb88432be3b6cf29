"""A fleet of three `moorage up` hosts on one PostgreSQL and one S3 server (SeaweedFS): any host serves any agent.

Users spread over the hosts continue on another host with their files; 100 concurrent requests through three
hosts wake a sleeping agent once; damaged snapshots fall back to the instance's older ones (never another's);
a killed host's users come back on the survivors within the lease TTL + 5 s with no acknowledged turn lost; a
host stopped past its lease and resumed cannot write the instance it lost (and a turn forwarded to it while it is
stopped is served by the forwarding host once its lease lapses).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage.devservices.fleet import pids_under
from tests.fleet.harness import Fleet, put_to_sleep, replied

LEASE_TTL_S = 4.0


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}")


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, s3: dict[str, str]) -> Iterator[Fleet]:
    f = Fleet(tmp_path, pg_url, s3)
    f.deploy()
    yield f
    f.close()


def test_thirty_users_spread_over_three_hosts_continue_on_another_host(fleet: Fleet) -> None:
    users = [f"u{i:02d}" for i in range(30)]
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(lambda iu: replied(fleet.turn(iu[0] % 3, iu[1])), enumerate(users))) == ["1: hi"] * 30
        recs = fleet.records()
        assert {recs[u].host for u in users} == {"h1", "h2", "h3"}  # each provisioned where its first turn went
        # Asleep: each sleep is shipped (the request reaches the owner wherever it is sent).
        list(pool.map(lambda iu: put_to_sleep(fleet, iu[1], via=(iu[0] + 2) % 3), enumerate(users)))
        # The next turn of every user lands on a different host, which wakes it from the object store.
        assert list(pool.map(lambda iu: replied(fleet.turn((iu[0] + 1) % 3, iu[1])), enumerate(users))) == ["2: hi"] * 30
    recs = fleet.records()
    for i, u in enumerate(users):
        assert recs[u].host == f"h{(i + 1) % 3 + 1}" and recs[u].state == "running"
        assert recs[u].lease_epoch == 1 and recs[u].meta["resumed_from"]["from"] == "shipped"
    # An awake instance asked through another host is served by its owner (forwarded, one hop).
    r = fleet.turn(0, "u01")
    assert replied(r) == "3: hi" and r.headers["x-moorage-served-by"] == "h3"
    # `moorage hosts` lists the three with their instances.
    import json
    import subprocess
    import sys

    out = subprocess.run([str(Path(sys.executable).parent / "moorage"), "hosts", "--json"], capture_output=True, text=True,
                         env={**os.environ, "MOORAGE_STORE_URL": fleet.store_url}, timeout=120, check=True)
    listed = {h["id"]: h for h in json.loads(out.stdout)["data"]}
    assert set(listed) == {"h1", "h2", "h3"} and all(h["state"] == "active" for h in listed.values())
    assert sum(h["instances"].get("running", 0) for h in listed.values()) == 30
    # The store named on the command line does the same; without a fleet store it says so, creating nothing.
    env = {k: v for k, v in os.environ.items() if k != "MOORAGE_STORE_URL"}
    env["MOORAGE_DATA_DIR"] = str(fleet.base / "cli-data")
    out = subprocess.run([str(Path(sys.executable).parent / "moorage"), "hosts", "--json", "--store-url",
                          fleet.store_url], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert {h["id"] for h in json.loads(out.stdout)["data"]} == {"h1", "h2", "h3"}
    bare = subprocess.run([str(Path(sys.executable).parent / "moorage"), "hosts"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert bare.returncode == 2 and "PostgreSQL store" in bare.stderr and "--store-url" in bare.stderr, bare
    assert not (fleet.base / "cli-data").exists()


def test_a_hundred_concurrent_requests_through_three_hosts_wake_a_sleeping_agent_once(fleet: Fleet) -> None:
    assert replied(fleet.turn(0, "crowd")) == "1: hi"
    put_to_sleep(fleet, "crowd")
    sid = fleet.records()["crowd"].id
    before = len([s for s in fleet.spans("lifecycle.claim_wake") if s.attrs.get("instance") == sid])
    with ThreadPoolExecutor(100) as pool:
        codes = list(pool.map(lambda i: fleet.api[i % 3].post("/v1/agents/echo/invoke", json={
            "message": "hi", "user": "crowd", "session": f"s{i}"}).status_code, range(100)))
    assert set(codes) <= {200, 429} and codes.count(200) >= 1, codes
    wakes = [s for s in fleet.spans("lifecycle.claim_wake") if s.attrs.get("instance") == sid]
    assert len(wakes) - before == 1
    assert fleet.records()["crowd"].state == "running"


def test_a_damaged_snapshot_falls_back_to_the_instances_older_one_never_another(fleet: Fleet, seaweedfs, s3_bucket,  # noqa: ANN001
                                                                                s3: dict[str, str]) -> None:
    assert replied(fleet.turn(0, "dmg")) == "1: hi"
    put_to_sleep(fleet, "dmg")                              # snapshot A: counter 1
    assert replied(fleet.turn(1, "dmg")) == "2: hi"       # woken on h2 from A
    put_to_sleep(fleet, "dmg", via=1)                       # snapshot B: counter 2
    assert replied(fleet.turn(0, "other")) == "1: hi"     # another user with snapshots of its own
    put_to_sleep(fleet, "other")
    rec = fleet.records()["dmg"]
    prefix = s3["object_store_url"].split("/", 3)[3]
    raw = seaweedfs.client()
    chunks = [o["Key"] for o in raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/")["Contents"]
              if f"/{rec.id}/chunks/" in o["Key"]]
    manifest_b = rec.meta["shipped"]["key"]
    import json

    body = json.loads(raw.get_object(Bucket=s3_bucket, Key=f"{prefix}/{manifest_b}")["Body"].read())
    # The instance's own file (copies of it in sandbox checkpoints hold older counts).
    counter = next(e for e in body["entries"] if e["path"] == "layer/work/counter.txt")["chunks"][0]
    key = next(k for k in chunks if k.endswith(counter))
    head = raw.head_object(Bucket=s3_bucket, Key=key)
    raw.put_object(Bucket=s3_bucket, Key=key, Body=b"9" * head["ContentLength"], Metadata=head["Metadata"])
    # Woken on h3: B is damaged, so it resumes from A (its own older snapshot), with a clear record of that.
    assert replied(fleet.turn(2, "dmg")) == "2: hi"
    resumed = fleet.records()["dmg"].meta["resumed_from"]
    assert resumed["fallback"] is True and resumed["key"] != manifest_b
    # Nothing of its own left in the bucket: provisioned again from the template (its turns are all in the store).
    put_to_sleep(fleet, "dmg", via=2)
    for o in raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/")["Contents"]:
        if f"/{rec.id}/" in o["Key"]:
            raw.delete_object(Bucket=s3_bucket, Key=o["Key"])
    assert replied(fleet.turn(0, "dmg")) == "1: hi"
    assert replied(fleet.turn(1, "other")) == "2: hi"  # the other user's state was never touched


def test_a_killed_host_s_users_come_back_on_the_survivors_with_no_acknowledged_turn_lost(fleet: Fleet) -> None:
    users = [f"k{i}" for i in range(9)]
    woke: dict[str, float] = {}
    for i, u in enumerate(users):
        assert replied(fleet.turn(i % 3, u)) == "1: hi"
        put_to_sleep(fleet, u)
        woke[u] = time.time()
        assert replied(fleet.turn(i % 3, u)) == "2: hi"  # awake again, this turn not shipped yet
    victims = [u for i, u in enumerate(users) if i % 3 == 1]
    time.sleep(3.0)  # awake instances are shipped after their turns (at most every 2 s)
    in_flight = threading.Thread(target=lambda: _swallow(lambda: fleet.turn(1, victims[0], "slow")))
    in_flight.start()
    time.sleep(1.0)
    fleet.hosts[1].kill()
    killed_at = time.time()
    in_flight.join()
    assert pids_under(fleet.hosts[1].data) == []  # nothing of h2 runs any more

    replies: list[str] = []

    def back(u: str) -> float:
        while True:
            r = fleet.turn(0, u)
            if r.status_code == 200:
                replies.append(r.json()["reply"])
                return time.time() - killed_at
            assert r.status_code in (409, 503), r.text
            time.sleep(0.2)

    with ThreadPoolExecutor(3) as pool:
        took = list(pool.map(back, victims))
    assert max(took) <= LEASE_TTL_S + 5, took
    recs = fleet.records()
    for u in victims:
        assert recs[u].host == "h1" and recs[u].state == "running" and recs[u].lease_epoch >= 1
        assert recs[u].meta["resumed_from"]["from"] == "shipped"  # from what h2 shipped while it was awake
    # Their files came back as of their last acknowledged turn (shipped while awake), not their last sleep.
    assert [r for r in replies if r != "3: hi"] == []
    # Every acknowledged turn is in the store (replies came back, so their runs committed).
    from moorage.config import Config
    from moorage.store import open_store

    store = open_store(Config(store_url=fleet.store_url))
    try:
        ts = next(store.operator.tenants())
        for u in users:
            done = [r for r in ts.runs.list(limit=10000) if r.scope.user == u and r.status == "succeeded"]
            assert len(done) >= 2, (u, done)
        # The awake time each victim had on h2 is billed once, by h1's takeover: up to its last activity there,
        # not the lease's wait nor anything after (it was lost: h1's wake stamped a new start).
        for u in victims:
            taken = ts.read("SELECT amount FROM usage WHERE kind = 'compute_seconds' AND user_id = ? AND ts > ?",
                            [u, killed_at])
            assert len(taken) == 1 and 0.0 <= taken[0][0] <= killed_at - woke[u] + 0.5, (u, taken)
    finally:
        store.close()
    # Survivors' own users were never moved.
    for i, u in enumerate(users):
        if i % 3 != 1:
            assert recs[u].host == f"h{i % 3 + 1}"


@pytest.mark.parametrize("sent_after_s", [LEASE_TTL_S + 1.5, 0.0], ids=["past-its-lease", "before-it-lapses"])
def test_a_host_stopped_past_its_lease_cannot_write_the_instance_it_lost(fleet: Fleet, sent_after_s: float) -> None:
    """The turn sent to h1 past h3's lease is served by h1 at once; sent before it lapses, h1 forwards it to the
    frozen h3, gives up on it once the lease lapses, and serves it itself: the same answer, not h3's."""
    assert replied(fleet.turn(2, "stale")) == "1: hi"
    put_to_sleep(fleet, "stale", via=2)
    result: dict[str, httpx.Response] = {}
    slow = threading.Thread(target=lambda: result.setdefault("r", fleet.turn(2, "stale", "slow")))
    slow.start()
    time.sleep(1.5)  # h3 woke it and the slow turn is in the agent
    h3 = fleet.hosts[2]
    os.killpg(h3.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(sent_after_s)
        t0 = time.monotonic()
        taken = fleet.turn(0, "stale")  # h1 takes it over from the last shipped snapshot
        assert replied(taken) == "2: hi" and "x-moorage-served-by" not in taken.headers
        assert time.monotonic() - t0 < 60  # not the forward's read timeout
    finally:
        os.killpg(h3.proc.pid, signal.SIGCONT)
    slow.join(timeout=60)
    # h3's turn finished in its (now stale) copy, but its commit fails the epoch check: nothing of it is written.
    assert result["r"].status_code == 409 and result["r"].json()["type"].endswith("/lease-lost"), result["r"].text
    rec = fleet.records()["stale"]
    assert rec.host == "h1" and rec.lease_epoch >= 1
    # Asked through h3 now, the request is served by the owner; h3 stopped its copy.
    r = fleet.turn(2, "stale")
    assert replied(r) == "3: hi" and r.headers["x-moorage-served-by"] == "h1"
    deadline = time.time() + 10
    while pids_under(h3.data / "sandboxes" / rec.id) and time.time() < deadline:
        time.sleep(0.2)
    assert pids_under(h3.data / "sandboxes" / rec.id) == []


def _swallow(fn) -> None:  # noqa: ANN001
    try:
        fn()
    except httpx.HTTPError:
        pass


def test_forgetting_a_user_removes_their_snapshots_from_the_bucket(fleet: Fleet, seaweedfs, s3_bucket,  # noqa: ANN001
                                                                  s3: dict[str, str]) -> None:
    assert replied(fleet.turn(0, "gone")) == "1: hi"
    put_to_sleep(fleet, "gone")
    assert replied(fleet.turn(1, "gone")) == "2: hi"  # awake on h2 now, shipped once from h1
    assert replied(fleet.turn(0, "kept")) == "1: hi"
    put_to_sleep(fleet, "kept")
    ids = {u: fleet.records()[u].id for u in ("gone", "kept")}
    prefix = s3["object_store_url"].split("/", 3)[3]
    raw = seaweedfs.client()

    def objects_of(sid: str) -> list[str]:
        listed = raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/").get("Contents", [])
        return [o["Key"] for o in listed if f"/{sid}/" in o["Key"]]

    assert objects_of(ids["gone"]) and objects_of(ids["kept"])
    r = fleet.api[2].delete("/v1/agents/echo/users/gone")  # asked through a third host
    assert r.status_code in (200, 204), r.text
    assert objects_of(ids["gone"]) == []
    assert objects_of(ids["kept"])  # another user's snapshots stay
    assert "gone" not in fleet.records()


def test_a_host_with_other_installation_secrets_is_refused_as_it_joins(fleet: Fleet, tmp_path: Path) -> None:
    from moorage.devservices.fleet import LocalHost

    # Its own data directory elsewhere: its own token secret, operator token and secrets key (a forgotten copy).
    with pytest.raises(RuntimeError, match=r"api/token-secret differs from host h\d's"):
        LocalHost("stranger", tmp_path / "elsewhere" / "stranger", fleet.env, start_timeout_s=120)
    assert "stranger" not in {h.id for h in fleet.host_rows()}
    assert replied(fleet.turn(1, "still")) == "1: hi"  # the fleet serves on


def test_a_users_superseded_snapshots_leave_the_bucket(fleet: Fleet, seaweedfs, s3_bucket,  # noqa: ANN001
                                                       s3: dict[str, str]) -> None:
    import json

    for i in range(6):  # awake on one host, then the other: every turn and every sleep ships a snapshot
        assert replied(fleet.turn(i % 2, "many")) == f"{i + 1}: hi"
        put_to_sleep(fleet, "many", via=i % 2)
    rec = fleet.records()["many"]
    prefix = s3["object_store_url"].split("/", 3)[3]
    raw = seaweedfs.client()
    mine = [o["Key"] for o in raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/")["Contents"]
            if f"/{rec.id}/" in o["Key"]]
    manifests = sorted(k for k in mine if "/snapshots/" in k)
    # The newest (what the record names) and two fallbacks; the chunks are exactly theirs.
    assert len(manifests) == 3 and f"{prefix}/{rec.meta['shipped']['key']}" == manifests[-1], manifests
    referenced = set()
    for key in manifests:
        body = json.loads(raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        referenced |= {d for e in body["entries"] for d in e.get("chunks") or () if d}
    assert {k.rsplit("/", 1)[1] for k in mine if "/chunks/" in k} == referenced
    assert replied(fleet.turn(2, "many")) == "7: hi"  # a third host wakes it from the newest, whole


def test_draining_a_host_moves_its_agents_while_every_request_succeeds(fleet: Fleet) -> None:
    import subprocess
    import sys

    users = [f"d{i}" for i in range(6)]
    for u in users:
        assert replied(fleet.turn(1, u)) == "1: hi"  # awake on h2
    stop = threading.Event()
    codes: list[int] = []

    def traffic() -> None:  # the load balancer has taken h2 out of rotation: requests go to h1 and h3
        i = 0
        while not stop.is_set():
            codes.append(fleet.turn((i % 2) * 2, users[i % len(users)]).status_code)
            i += 1

    said: list[str] = []  # what h2's /readyz said until it stopped: what takes it out of a load balancer

    def probe() -> None:
        while fleet.hosts[1].proc.poll() is None:
            try:
                r = httpx.get(f"{fleet.hosts[1].url}/readyz", timeout=5)
                said.append(r.json()["status"])
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=traffic)
    t.start()
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        subprocess.run([str(Path(sys.executable).parent / "moorage"), "host", "drain", "h2", "--store-url",
                        fleet.store_url], check=True, timeout=60, capture_output=True,
                       env={k: v for k, v in os.environ.items() if k != "MOORAGE_STORE_URL"})
        assert fleet.hosts[1].proc.wait(timeout=90) == 0  # h2 slept everything and left cleanly
        time.sleep(1.0)
    finally:
        stop.set()
        t.join()
        prober.join()
    assert codes and set(codes) == {200}, codes
    # Ready until the drain began, then "draining" (and "stopping" as it left), never ready again.
    assert said and said[0] == "ready" and "draining" in said, " ".join(said[-20:])
    first_not = said.index("draining")
    assert set(said[first_not:]) <= {"draining", "stopping"}, said
    assert httpx.get(f"{fleet.hosts[0].url}/readyz", timeout=5).json() == {"status": "ready"}
    recs = fleet.records()
    # Nothing is left awake on h2: each user is on a survivor, or asleep with its last sleep shipped.
    for u in users:
        assert recs[u].host in ("h1", "h3") or (recs[u].state == "sleeping" and recs[u].meta["shipped_current"]), recs[u]
        assert fleet.turn(0, u).status_code == 200
    from moorage.config import Config
    from moorage.fleet.hosts import HostRegistry
    from moorage.store import open_store

    with open_store(Config(store_url=fleet.store_url)) as store:
        assert HostRegistry(store.backend).get("h2").state == "gone"


def test_a_hosts_copies_of_sleeping_agents_are_a_bounded_cache(tmp_path: Path, pg_url: str, s3: dict[str, str]) -> None:
    f = Fleet(tmp_path, pg_url, s3, n=2, fleet_cache_mib="0.2", checkpoint_interval_s="1")
    try:
        f.deploy()
        users = [f"c{i}" for i in range(8)]
        for u in users:
            assert replied(f.turn(0, u)) == "1: hi"
            put_to_sleep(f, u)
        root = f.hosts[0].data / "sandboxes"
        ids = {u: f.records()[u].id for u in users}

        def held() -> list[str]:
            return [u for u in users if (root / ids[u]).is_dir()]

        deadline = time.time() + 20
        while len(held()) == len(users) and time.time() < deadline:
            time.sleep(0.5)
        kept = held()
        assert len(kept) < len(users)  # least recently used copies evicted; only shipped ones may go
        # Every user still wakes where it slept, from the object store when its copy was evicted.
        for u in users:
            assert replied(f.turn(0, u)) == "2: hi"
        recs = f.records()
        assert {recs[u].meta["resumed_from"]["from"] for u in users if u not in kept} == {"shipped"}
        assert {recs[u].meta["resumed_from"]["from"] for u in kept} <= {"local", "shipped"}
    finally:
        f.close()


def test_a_tenants_awake_limit_counts_its_instances_on_every_host(tmp_path: Path, pg_url: str,
                                                                  s3: dict[str, str]) -> None:
    f = Fleet(tmp_path, pg_url, s3, max_awake_per_tenant="2")
    try:
        f.deploy()
        assert replied(f.turn(0, "a1")) == "1: hi"  # awake on h1
        assert replied(f.turn(1, "a2")) == "1: hi"  # awake on h2: the tenant's limit of 2 is reached fleet-wide
        r = f.turn(2, "a3")
        assert r.status_code == 429 and r.headers.get("Retry-After"), r.text
        assert "across the fleet's hosts" in r.json()["detail"], r.text  # not "on this host": it has none awake
        put_to_sleep(f, "a1")
        assert replied(f.turn(2, "a3")) == "1: hi"  # room again, on any host
    finally:
        f.close()
