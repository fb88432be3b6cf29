"""``DELETE /v1/tenants/{tenant}`` (the operator's) over a real runtime (process sandboxes), both store backends:
every key of the tenant and every end-user token they issued stop working at once, every agent, end-user and
instance goes (instances from the host's disk too), the tenant's store is gone (its SQLite file; its rows in every
PostgreSQL table), and another tenant keeps everything it had. Only the operator token deletes; a delete cut short
leaves the tenant marked (no new key) and sending it again finishes it; the name can be taken again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorage.errors import ConflictError, NotFound
from moorage.store import Scope, Store
from moorage.store.schema import TENANT_MIGRATIONS
from tests.api.conftest import aclient, agent_archive, sse_events

GZ = {"content-type": "application/gzip"}


def tenant_left(store: Store, tenant_id: str) -> dict[str, int]:
    """What the store still has of a tenant: its SQLite file, or its rows in each PostgreSQL table."""
    backend = store.backend
    if hasattr(backend, "tenant_path"):
        path = Path(backend.tenant_path(tenant_id))
        return {"file": 1} if path.exists() else {}
    left: dict[str, int] = {}
    with backend.tenant_tx(tenant_id, write=False) as c:
        for table in {t for m in TENANT_MIGRATIONS for t in m.tenant_tables}:
            n = int(c.one(f"SELECT count(*) FROM {table}")[0])
            if n:
                left[table] = n
    return left


async def _deploy(c: Any, tmp_path: Path, agent: str) -> None:
    r = await c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
    assert r.status_code == 201, r.text


async def _turn(c: Any, agent: str, user: str) -> Any:
    return await c.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})


async def test_deleting_a_tenant_removes_all_it_had_and_nothing_of_another(live_rt, runtime, store: Store, acme: str,
                                                                            globex: str, tmp_path: Path) -> None:
    acme_id, globex_id = store.authenticate(acme).tenant_id, store.authenticate(globex).tenant_id
    async with aclient(live_rt, acme) as c, aclient(live_rt, globex) as g:
        for agent in ("helper", "coder"):
            await _deploy(c, tmp_path, agent)
            for user in ("ada", "bob"):
                assert (await _turn(c, agent, user)).status_code == 200
        await _deploy(g, tmp_path, "helper")
        assert (await _turn(g, "helper", "ada")).json()["reply"] == "echo: hi"
        assert (await c.put("/v1/agents/helper/secrets/API", json={"value": "s3cret"})).status_code == 200
        assert (await c.post("/v1/agents/helper/webhooks", json={"url": "http://127.0.0.1:9/hook"})).status_code == 201
        issued = await c.post("/v1/agents/helper/users/ada/tokens", json={})
        assert issued.status_code == 201, issued.text
        token = issued.json()["token"]
        ts = store.tenant(store.authenticate(acme))
        bound = ts.keys.create(["invoke"], agent="coder").secret
        boxes = {rec.id for rec in ts.sandboxes.list()}
        assert len(boxes) == 4 and all((runtime.driver.root / b).exists() for b in boxes)
        ts.sandboxes.create(Scope.workflow("coder", "run-1"), state="sleeping")  # an instance no user owns, recorded
        globex_boxes = {rec.id for rec in store.tenant(store.authenticate(globex)).sandboxes.list()}

        # Only the operator token deletes a tenant: its own admin key, another tenant's, none: 401, nothing changed.
        for credential in (acme, globex, None):
            async with aclient(live_rt, credential) as k:
                assert (await k.delete("/v1/tenants/acme")).status_code == 401
                assert (await k.get("/v1/tenants")).status_code == 401
        assert (await _turn(c, "helper", "ada")).status_code == 200
        async with aclient(live_rt, _operator(live_rt)) as op:
            assert (await op.delete("/v1/tenants/initech")).status_code == 404
            events = await sse_events(op, "DELETE", "/v1/tenants/acme?stream=true")
        kinds = [k for k, _ in events]
        said = [d["message"] for k, d in events if k == "progress"]
        assert kinds[-1] == "deleted" and set(kinds[:-1]) == {"progress"}, events
        assert said[0] == "deleting agent coder (1 of 2)" and "deleting agent helper (2 of 2)" in said, said
        assert any(m.startswith("helper: forgetting 2 end-users") for m in said) and said[-1] == \
            "deleting the tenant's store", said
        done = events[-1][1]
        assert done == {"tenant": {"id": acme_id, "name": "acme"}, "deleted": True, "agents": 2, "users": 4,
                        "removed": done["removed"], "keys_revoked": 2}, done

        # Gone: the tenant, every credential of it, its instances, its store.
        with pytest.raises(NotFound):
            store.operator.get_tenant("acme")
        for credential in (acme, bound, token):
            async with aclient(live_rt, credential) as k:
                assert (await _turn(k, "helper", "ada")).status_code == 401
                assert (await k.get("/v1/agents")).status_code == 401
        assert not any((runtime.driver.root / b).exists() for b in boxes)
        assert tenant_left(store, acme_id) == {}
        assert store.backend.list_api_keys(acme_id) == []

        # The other tenant has all it had: its agent remembers, its instance is there.
        assert (await _turn(g, "helper", "ada")).json()["reply"] == "echo: hi"
        assert [u["id"] for u in (await g.get("/v1/agents/helper/users")).json()["data"]] == ["ada"]
        assert all((runtime.driver.root / b).exists() for b in globex_boxes)
        assert tenant_left(store, globex_id) != {}

    # The name is free: a new tenant of that name starts empty.
    _, key = store.operator.create_tenant("acme")
    async with aclient(live_rt, key.secret) as c:
        assert (await c.get("/v1/agents")).json()["data"] == []


def _operator(live: Any) -> str:
    return (live.data_dir / "api" / "operator-token").read_text().strip()


async def test_a_delete_cut_short_leaves_the_tenant_marked_and_sending_it_again_finishes_it(
        live_rt, store: Store, acme: str, tmp_path: Path) -> None:
    """Marked (a delete a stopped host cut short, after it revoked the keys): no key is made for the tenant, it is
    listed as being deleted, and the same DELETE, by id this time, finishes it."""
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path, "helper")
        assert (await _turn(c, "helper", "ada")).status_code == 200
    tenant = store.backend.mark_tenant_deleting(store.authenticate(acme).tenant_id)
    since = tenant.deleting_since
    assert since and store.backend.mark_tenant_deleting(tenant.id).deleting_since == since  # the first mark stays
    assert [t.deleting_since for t in store.operator.list_tenants()] == [since]
    with pytest.raises(ConflictError):
        store.backend.create_api_key(tenant.id, ["admin"])
    with pytest.raises(ConflictError):
        store.operator.create_tenant("acme")  # the name is not free until the delete ends
    async with aclient(live_rt, _operator(live_rt)) as op:
        (listed,) = (await op.get("/v1/tenants")).json()["data"]  # what the operator's listing says of it
        assert listed == {"id": tenant.id, "name": "acme", "created_at": tenant.created_at, "limits": {},
                          "deleting_since": since}, listed
        r = await op.delete(f"/v1/tenants/{tenant.id}")
        assert r.status_code == 200 and r.json()["agents"] == 1 and r.json()["users"] == 1, r.text
        assert (await op.delete(f"/v1/tenants/{tenant.id}")).status_code == 404
    assert store.operator.list_tenants() == [] and tenant_left(store, tenant.id) == {}


async def test_a_caller_that_leaves_does_not_cut_the_delete(live_rt, store: Store, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        await _deploy(c, tmp_path, "helper")
        for i in range(6):
            assert (await c.put(f"/v1/agents/helper/users/u{i}", json={})).status_code == 201
    async with aclient(live_rt, _operator(live_rt)) as op:
        first = await sse_events(op, "DELETE", "/v1/tenants/acme?stream=true", stop_after=1)
        assert first[0] == ("progress", {"message": "deleting agent helper (1 of 1)"})
    for _ in range(300):
        if not store.operator.list_tenants():
            break
        await asyncio.sleep(0.1)
    assert store.operator.list_tenants() == []


def test_a_server_without_a_runtime_refuses_before_it_starts(live, store: Store, acme: str) -> None:
    """A store-only server has no instances to stop: the delete is a 503 naming what to run, and nothing changes."""
    with live.client(live.operator_token) as c:
        r = c.delete("/v1/tenants/acme")
    assert r.status_code == 503 and "moorage up" in r.json()["hint"], r.text
    assert store.operator.get_tenant("acme").deleting_since is None
    assert store.tenant(store.authenticate(acme)).tenant_id


async def test_a_tenant_delete_and_an_online_backup_do_not_run_together(live_rt, runtime, store: Store, acme: str,
                                                                        tmp_path: Path) -> None:
    """The backup copies each tenant's store and instances, which the delete removes under it: whichever comes
    second is a 409 saying what to wait for, and changes nothing."""
    from types import SimpleNamespace

    from moorage.runtime.admin_socket import AdminSocket

    runtime.backing_up = True  # as the admin socket sets it while `moorage backup` runs
    try:
        async with aclient(live_rt, _operator(live_rt)) as op:
            r = await op.delete("/v1/tenants/acme")
        assert r.status_code == 409 and "online backup" in r.json()["detail"], r.text
        assert store.operator.get_tenant("acme").deleting_since is None
    finally:
        runtime.backing_up = False

    runtime.deleting_tenants.add("acme")  # as a delete running on this host holds it
    try:
        admin = AdminSocket(SimpleNamespace(runtime=runtime, config=runtime.config))
        with pytest.raises(ConflictError) as e:
            await admin._run_backup(tmp_path / "backup", lambda event: None)
        assert "tenant acme is being deleted" in e.value.message and not (tmp_path / "backup").exists()
        assert runtime.backing_up is False
    finally:
        runtime.deleting_tenants.discard("acme")
