"""A deployment goes ready and live in one transaction (``Deployments.set_status(..., live_lifecycle=...)``), on both
store backends: the newest deployment of an agent wins, and a transaction cut short leaves neither."""

from __future__ import annotations

import pytest

from moorage.store import DEPLOYMENT_BUILDING, DEPLOYMENT_READY, TenantStore
from moorage.store import zero_retention


def test_ready_and_live_together_and_the_newest_wins(tenant: TenantStore) -> None:
    agent = tenant.agents.create("a", {"other": 1})
    d1, d2 = (tenant.deployments.create(agent.id, {"n": n}, f"p{n}", "sha") for n in (1, 2))
    tenant.deployments.set_status(d2.id, DEPLOYMENT_READY, live_lifecycle={"pool": 2})
    live = tenant.agents.get("a")
    assert live.live_deployment == d2.id and live.config == {"other": 1, "lifecycle": {"pool": 2}}
    assert live.version == agent.version + 1
    # The older one finishing later is ready, not live.
    assert tenant.deployments.set_status(d1.id, DEPLOYMENT_READY, live_lifecycle={"pool": 1}).status == DEPLOYMENT_READY
    assert tenant.agents.get("a") == live


def test_a_go_live_cut_short_leaves_the_deploy_building_and_nothing_live(tenant: TenantStore) -> None:
    agent = tenant.agents.create("a")
    dep = tenant.deployments.create(agent.id, {}, "p", "sha")
    with pytest.raises(RuntimeError), tenant.transaction():
        tenant.deployments.set_status(dep.id, DEPLOYMENT_READY, live_lifecycle={})
        zero_retention.set_zero(tenant, "a", True)
        raise RuntimeError("the host died here")
    assert tenant.deployments.get(dep.id).status == DEPLOYMENT_BUILDING
    after = tenant.agents.get("a")
    assert after.live_deployment is None and not zero_retention.is_zero(after)


def test_a_tenants_packages_count_once_each_and_rows_without_a_size_not_at_all(tenant: TenantStore,
                                                                             other_tenant: TenantStore) -> None:
    """``package_bytes`` (the tenant ceiling counts it, usage/tenant_cap.py): each package once however many
    deployments name it; a deployment an older host recorded has no size; another tenant's are its own."""
    a, b = tenant.agents.create("a"), tenant.agents.create("b")
    assert tenant.deployments.package_bytes() == 0 and not tenant.deployments.has_package("s1")
    tenant.deployments.create(a.id, {}, "packages/s1.tar.gz", "s1", package_bytes=1000)
    tenant.deployments.create(a.id, {}, "packages/s1.tar.gz", "s1", package_bytes=1000)  # redeployed as it was
    tenant.deployments.create(b.id, {}, "packages/s1.tar.gz", "s1", package_bytes=1000)  # the same bytes, another agent
    tenant.deployments.create(b.id, {}, "packages/s2.tar.gz", "s2", package_bytes=250)
    tenant.deployments.create(b.id, {}, "packages/s3.tar.gz", "s3")  # before store migration 32: no size
    assert tenant.deployments.package_bytes() == 1250
    assert tenant.deployments.has_package("s1") and tenant.deployments.has_package("s3")
    assert other_tenant.deployments.package_bytes() == 0 and not other_tenant.deployments.has_package("s1")


def test_a_deleted_deployment_keeps_its_number_and_its_package_stops_counting(tenant: TenantStore) -> None:
    """``delete``: neither the live one nor one building; the row stays (a number is never given twice; a turn that
    began on it reads its manifest), is not listed, and its package no longer counts nor is named; deleting it again
    answers the same."""
    from moorage.errors import ConflictError
    from moorage.store import DEPLOYMENT_DELETED, DEPLOYMENT_FAILED

    agent = tenant.agents.create("a")
    d1, d2, d3 = (tenant.deployments.create(agent.id, {"n": n}, f"packages/s{n}.tar.gz", f"s{n}", package_bytes=100 * n)
                  for n in (1, 2, 3))
    tenant.deployments.set_status(d1.id, DEPLOYMENT_READY, live_lifecycle={})
    with pytest.raises(ConflictError, match="live"):
        tenant.deployments.delete(d1.id)
    with pytest.raises(ConflictError, match="building"):
        tenant.deployments.delete(d2.id)
    tenant.deployments.set_status(d3.id, DEPLOYMENT_FAILED)
    assert tenant.deployments.package_bytes() == 600 and tenant.deployments.packages() == {"s1", "s2", "s3"}
    version = tenant.agents.get("a").version
    gone = tenant.deployments.delete(d3.id)
    assert (gone.status, gone.number, gone.manifest) == (DEPLOYMENT_DELETED, 3, {"n": 3})
    assert tenant.deployments.get(d3.id) == gone
    assert tenant.agents.get("a").version == version + 1  # a rollback that read the agent before fails its CAS
    assert tenant.deployments.delete(d3.id) == gone
    assert [d.number for d in tenant.deployments.list(agent.id)] == [1, 2]
    assert [d.number for d in tenant.deployments.list(agent.id, deleted=True)] == [1, 2, 3]
    assert tenant.deployments.package_bytes() == 300 and tenant.deployments.packages() == {"s1", "s2"}
    assert not tenant.deployments.has_package("s3")
    assert tenant.deployments.create(agent.id, {}, "p", "s4").number == 4  # not 3 again


def test_prune_keeps_the_newest_the_live_one_and_any_building(tenant: TenantStore) -> None:
    agent = tenant.agents.create("a")
    deps = [tenant.deployments.create(agent.id, {}, f"p{n}", f"s{n}") for n in range(1, 8)]
    for d in deps[:6]:
        tenant.deployments.set_status(d.id, DEPLOYMENT_READY)
    tenant.deployments.set_status(deps[1].id, DEPLOYMENT_READY, live_lifecycle={})  # 2 live (rolled back to)
    # 7 building, 2 live: kept with the newest three (7, 6, 5); 1, 3 and 4 go.
    pruned = tenant.deployments.prune(agent.id, 3)
    assert sorted(d.number for d in pruned) == [1, 3, 4]
    assert [d.number for d in tenant.deployments.list(agent.id)] == [2, 5, 6, 7]
    assert tenant.deployments.prune(agent.id, 3) == []  # the live and the building one are over the count, kept
    with pytest.raises(ValueError):
        tenant.deployments.prune(agent.id, 0)


def test_a_deleted_deployment_cannot_be_made_live(tenant: TenantStore) -> None:
    """The agent's compare-and-set refuses a deployment deleted meanwhile, whatever version the caller read."""
    from moorage.errors import NotFound

    agent = tenant.agents.create("a")
    d1, d2 = (tenant.deployments.create(agent.id, {}, f"p{n}", f"s{n}") for n in (1, 2))
    for d in (d1, d2):
        tenant.deployments.set_status(d.id, DEPLOYMENT_READY, live_lifecycle={})
    tenant.deployments.delete(d1.id)
    current = tenant.agents.get("a")
    with pytest.raises(NotFound, match="deleted"):
        tenant.agents.update(agent.id, expected_version=current.version, live_deployment=d1.id)
    assert tenant.agents.get("a").live_deployment == d2.id
