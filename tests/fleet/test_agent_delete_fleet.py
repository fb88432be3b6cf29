"""Deleting a whole agent (DELETE /v1/agents/{agent}), or a whole tenant (DELETE /v1/tenants/{tenant}), in a fleet
of two `moorage up` hosts (PostgreSQL, SeaweedFS), through the host that holds none of its instances: the other host
is asked to let go of the ones it holds awake (a turn running there is cancelled), each instance is taken and
destroyed, its shipped snapshots leave the bucket and its copies every host's disk, and no host serves the agent
(or takes the tenant's keys) afterwards; the name is then free on every host."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.store import open_store
from tests.api.test_tenant_delete import tenant_left
from tests.fleet.harness import Fleet, put_to_sleep, replied, until
from tests.fleet.test_forget_fleet import _objects_of, _running

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}")


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, s3: dict[str, str]) -> Iterator[Fleet]:
    f = Fleet(tmp_path, pg_url, s3, n=2, checkpoint_interval_s="1")  # copies of forgotten instances: every 5 s
    try:
        f.deploy()
        yield f
    finally:
        f.close()


def _ada_awake_on_h1_bob_shipped(f: Fleet, seaweedfs, s3_bucket: str, s3: dict[str, str]) -> dict:  # noqa: ANN001
    """ada awake on h1 (shipped while awake), bob asleep and shipped; their records."""
    assert replied(f.turn(0, "ada")) == "1: hi"
    assert replied(f.turn(0, "bob")) == "1: hi"
    put_to_sleep(f, "bob")
    recs = f.records()
    assert recs["ada"].host == "h1" and recs["bob"].state == "sleeping"
    until(lambda: _objects_of(seaweedfs, s3_bucket, s3, recs["ada"].id), "ada shipped while awake", 30)
    return recs


def test_an_agent_deleted_through_another_host_leaves_every_host_and_the_bucket(
        fleet: Fleet, seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f = fleet
    recs = _ada_awake_on_h1_bob_shipped(f, seaweedfs, s3_bucket, s3)
    assert _objects_of(seaweedfs, s3_bucket, s3, recs["bob"].id)

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(f.turn, 0, "ada", "slow")            # 4 s on h1
        until(lambda: _running(f, "ada"), "the slow turn runs", timeout_s=30, every_s=0.1)
        r = f.api[1].delete("/v1/agents/echo")
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] is True and r.json()["users"] == 2, r.text
        assert "x-moorage-served-by" not in r.headers           # served where it was sent; h1 let go of ada
        turn = slow.result(timeout=60)
    assert turn.status_code == 409, turn.text                   # cancelled: its agent is gone

    assert f.records() == {}
    for via in (0, 1):
        assert f.api[via].get("/v1/agents/echo").status_code == 404
        assert f.turn(via, "ada").status_code == 404
    time.sleep(3)  # a shipment after the turn would have reached the bucket by now
    for user in ("ada", "bob"):
        assert _objects_of(seaweedfs, s3_bucket, s3, recs[user].id) == [], user
    # The copies another host's disk kept of them go at its next removal of forgotten instances' copies.
    until(lambda: not any((h.data / "sandboxes" / recs[u].id).exists() for h in f.hosts for u in ("ada", "bob")),
          "no host's disk keeps their instances", 30)

    f.deploy()                                                   # the name is free: a new agent, empty
    assert replied(f.turn(1, "ada")) == "1: hi"


def test_a_tenant_deleted_through_another_host_leaves_every_host_the_bucket_and_the_store(
        fleet: Fleet, seaweedfs, s3_bucket, s3: dict[str, str]) -> None:  # noqa: ANN001
    f = fleet
    recs = _ada_awake_on_h1_bob_shipped(f, seaweedfs, s3_bucket, s3)
    store = open_store(Config(store_url=f.store_url))
    (tenant,) = store.operator.list_tenants()
    operator = (f.hosts[1].data / "api" / "operator-token").read_text().strip()

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(f.turn, 0, "ada", "slow")            # 4 s on h1
        until(lambda: _running(f, "ada"), "the slow turn runs", timeout_s=30, every_s=0.1)
        r = f.hosts[1].client(operator).delete(f"/v1/tenants/{tenant.name}")
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] is True and r.json()["agents"] == 1 and r.json()["users"] == 2, r.text
        turn = slow.result(timeout=60)
    assert turn.status_code in (401, 409), turn.text            # cancelled: its tenant is gone

    try:
        assert store.operator.list_tenants() == [] and store.backend.list_api_keys(tenant.id) == []
        assert tenant_left(store, tenant.id) == {}               # no row of it in any table
    finally:
        store.close()
    for via in (0, 1):
        assert f.api[via].get("/v1/agents").status_code == 401  # its key, on every host
    time.sleep(3)  # a shipment after the turn would have reached the bucket by now
    prefix = s3["object_store_url"].split("/", 3)[3]
    left = seaweedfs.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/instances/{tenant.id}/")
    assert left.get("Contents", []) == []
    until(lambda: not any((h.data / "sandboxes" / recs[u].id).exists() for h in f.hosts for u in ("ada", "bob")),
          "no host's disk keeps their instances", 30)


POOLED = 'async def on_message(ctx, message):\n    return "{v}: " + message\n'


def _pools(host_data: Path) -> dict[str, list[str]]:
    """A host's warm pools: template id -> its pooled forks (lifecycle/pool.py's manifests)."""
    return {p.stem: json.loads(p.read_text()) for p in (host_data / "pool").glob("*.json")}


def test_a_warm_pool_on_another_host_goes_with_its_replaced_template(tmp_path: Path, pg_url: str,
                                                                     s3: dict[str, str]) -> None:
    """h2 served the agent, so it keeps forks of its template ready (``lifecycle.pool``). The agent is redeployed
    through h1: h2's next collection drops the replaced template, and now its pool with it. It kept refilling forks
    of a template it had deleted, until it restarted; an agent deleted in a fleet left the same behind."""
    f = Fleet(tmp_path, pg_url, s3, n=2, template_gc_interval_s="1", template_gc_grace_s="2")
    try:
        for v in ("v1", "v2"):
            d = tmp_path / f"pooled-{v}"
            d.mkdir()
            (d / "moorage.toml").write_text('[agent]\nname = "pooled"\nentry = "agent.py"\n'
                                            '[agent.lifecycle]\nusers = "auto"\npool = 2\n')
            (d / "agent.py").write_text(POOLED.replace("{v}", v))
        deploy = (lambda v: f.api[0].post("/v1/agents/pooled/deployments", content=tar_dir(tmp_path / f"pooled-{v}"),
                                          headers={"Content-Type": "application/gzip"}))
        assert deploy("v1").status_code == 201
        r = f.api[1].post("/v1/agents/pooled/invoke", json={"message": "hi", "user": "pat"})
        assert replied(r) == "v1: hi"
        until(lambda: any(len(m) == 2 for m in _pools(f.hosts[1].data).values()), "h2's pool filled", 60)
        (old,) = _pools(f.hosts[1].data)
        assert deploy("v2").status_code == 201
        until(lambda: old not in _pools(f.hosts[1].data), "h2's pool of the replaced template drained", 60)
        r = f.api[1].post("/v1/agents/pooled/invoke", json={"message": "hi", "user": "quinn"})
        assert replied(r) == "v2: hi"
    finally:
        f.close()
