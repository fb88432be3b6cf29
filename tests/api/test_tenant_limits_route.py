"""The operator's routes for a tenant's own limits (``GET``/``PUT /v1/tenants/{tenant}/limits``): the operator token
only, by name or id, bad input refused with nothing changed, and a change applied by the serving host to the
tenant's next write (not a minute later)."""

from __future__ import annotations

from moorage.store import Scope, Store
from tests.api.conftest import aclient

FACT = {"subject": "user", "attribute": "motto", "value": "x" * 4000}


def test_the_operator_reads_and_sets_a_tenants_ceiling_by_name_or_id(live, store: Store, acme: str) -> None:
    acme_id = store.authenticate(acme).tenant_id
    with live.client(live.operator_token) as c:
        r = c.get("/v1/tenants/acme/limits")
        assert r.status_code == 200 and r.json() == {"tenant": {"id": acme_id, "name": "acme"}, "limits": {},
                                                     "storage_mib": 0, "default_storage_mib": 0}, r.text
        r = c.put(f"/v1/tenants/{acme_id}/limits", json={"storage_mib": 512})
        assert r.status_code == 200 and r.json()["limits"] == {"storage_mib": 512} and r.json()["storage_mib"] == 512
        assert store.operator.tenant_limits("acme") == {"storage_mib": 512}
        assert c.get("/v1/tenants/acme/limits").json()["storage_mib"] == 512
        # null: back to the installation's default
        r = c.put("/v1/tenants/acme/limits", json={"storage_mib": None})
        assert r.status_code == 200 and r.json()["limits"] == {} and r.json()["storage_mib"] == 0, r.text
        assert store.operator.tenant_limits("acme") == {}


def test_bad_input_and_unknown_tenants_are_refused_and_change_nothing(live, store: Store, acme: str) -> None:
    store.operator.set_tenant_limits("acme", storage_mib=8)
    with live.client(live.operator_token) as c:
        for raw in (b'{}', b'{"storage_mib": -1}', b'{"storage_mib": "lots"}', b'{"storage_mib": true}',
                    b'{"storage_mib": 1e999}', b'[512]'):
            r = c.put("/v1/tenants/acme/limits", content=raw, headers={"content-type": "application/json"})
            assert r.status_code in (400, 422) and r.headers["content-type"].startswith("application/problem+json"), \
                (raw, r.status_code, r.text)
        assert store.operator.tenant_limits("acme") == {"storage_mib": 8}
        for method in ("get", "put"):
            r = getattr(c, method)("/v1/tenants/initech/limits", **({"json": {"storage_mib": 1}} if method == "put"
                                                                     else {}))
            assert r.status_code == 404 and "initech" in r.json()["detail"], r.text


def test_a_tenants_keys_and_tokens_cannot_read_or_set_limits(live, store: Store, acme: str, globex: str) -> None:
    """Operator routes take the operator token only: a tenant's admin key (its own tenant or another's) is a 401,
    as is no credential; nothing changes."""
    for credential in (acme, globex, None):
        with live.client(credential) as c:
            assert c.get("/v1/tenants/acme/limits").status_code == 401
            assert c.put("/v1/tenants/acme/limits", json={"storage_mib": 0}).status_code == 401
            assert c.put("/v1/tenants/globex/limits", json={"storage_mib": 9999}).status_code == 401
    assert store.operator.tenant_limits("acme") == {} and store.operator.tenant_limits("globex") == {}


async def test_the_serving_host_applies_a_change_to_the_tenants_next_write(live_rt, store: Store, acme: str) -> None:
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("pal", {"lifecycle": {"users": "auto"}})
    async with aclient(live_rt, acme) as c:
        # The first write reads the tenant's limits (none) and keeps them for a minute.
        assert (await c.post("/v1/agents/pal/users/ada/facts", json=FACT)).status_code == 201
        async with aclient(live_rt, live_rt.operator_token) as op:
            r = await op.put("/v1/tenants/acme/limits", json={"storage_mib": 0.001})
            assert r.status_code == 200, r.text
        r = await c.post("/v1/agents/pal/users/bob/facts", json=FACT)
        assert r.status_code == 507 and r.json()["type"].endswith("/tenant-storage-exceeded"), r.text
        assert ts.facts.list(Scope.for_user("pal", "bob")) == []
        async with aclient(live_rt, live_rt.operator_token) as op:
            assert (await op.put("/v1/tenants/acme/limits", json={"storage_mib": None})).status_code == 200
        assert (await c.post("/v1/agents/pal/users/bob/facts", json=FACT)).status_code == 201
