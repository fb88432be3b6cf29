"""The store's half of deleting an agent (``store/forget_agent.py``), on both backends: an agent marked as being
deleted takes no new live deployment; its final transaction is refused whole while an instance of it is still
recorded (a turn made one after the runtime forgot its users), and then takes everything, the other agent's rows
untouched."""

from __future__ import annotations

import pytest

from moorage.errors import ConflictError
from moorage.store import DEPLOYMENT_READY, Scope, TenantStore
from moorage.store.forget_agent import InstancesLeft, forget_agent, users_of


def test_a_marked_agent_takes_no_live_deployment_and_is_deleted_only_once_no_instance_is_left(
        tenant: TenantStore) -> None:
    a, keep = tenant.agents.create("a"), tenant.agents.create("keep")
    d1 = tenant.deployments.create(a.id, {}, "p1", "sha1")
    d2 = tenant.deployments.create(a.id, {}, "p2", "sha2")
    tenant.deployments.set_status(d1.id, DEPLOYMENT_READY, live_lifecycle={})
    for agent in ("a", "keep"):
        tenant.agent_users.put(agent, "ada")
        tenant.state.put(Scope.for_user(agent, "ada"), "k", {"v": agent}, expected_version=0)
    tenant.sandboxes.create(Scope.for_user("a", "ada"), state="sleeping")
    marked = tenant.agents.mark_deleting("a")
    assert marked.config["deleting"]["since"] > 0 and tenant.agents.mark_deleting("a") == marked  # once
    with pytest.raises(ConflictError, match="being deleted"):
        tenant.deployments.set_status(d2.id, DEPLOYMENT_READY, live_lifecycle={})
    with pytest.raises(ConflictError, match="being deleted"):
        tenant.agents.update(marked.id, expected_version=marked.version, live_deployment=d1.id)
    assert users_of(tenant, "a") == ["ada"]

    with pytest.raises(InstancesLeft):
        forget_agent(tenant, marked)
    assert tenant.agents.get("a").id == a.id and tenant.state.get(Scope.for_user("a", "ada"), "k") is not None

    tenant.forget_user("ada", "a")  # what the runtime does for each user, their instance's record with it
    assert forget_agent(tenant, marked) > 0
    assert [x.name for x in tenant.agents.list()] == ["keep"] and tenant.deployments.list(a.id, deleted=True) == []
    assert users_of(tenant, "a") == []
    assert tenant.state.get(Scope.for_user("keep", "ada"), "k").value == {"v": "keep"}
    assert tenant.agents.get("keep") == keep
