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
