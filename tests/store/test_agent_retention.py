"""Retention per agent on both backends: an agent's own TTL sweeps its sessions, users and workflow runs once
idle that long, other agents' data stays, and the shorter of the kind's and the agent's TTL wins."""

from __future__ import annotations

import time

import pytest

from moorage.errors import InvalidInput, NotFound
from moorage.store import Scope, TenantStore
from moorage.store.repos.retention import DEFAULT_TTLS


def test_agent_ttl_sweeps_that_agents_events_and_runs_only(tenant: TenantStore) -> None:
    tenant.retention.set_agent("brief", 60)
    for agent in ("brief", "keeper"):
        tenant.events.append(Scope.session(agent, "ada", "s1"), "message", f"{agent} chat")
        tenant.state.put(Scope.for_user(agent, "ada"), "pref", "tea", expected_version=0)
        tenant.runs.create(Scope.workflow(agent, f"{agent}-run", user="ada"), "wf")
    assert tenant.sweep(now=time.time() + 30).scopes == 0  # not idle long enough yet
    rep = tenant.sweep(now=time.time() + 120)
    assert rep.scopes == 3 and rep.rows >= 3
    assert tenant.events.list(Scope.session("brief", "ada", "s1")) == []
    assert tenant.state.get(Scope.for_user("brief", "ada"), "pref") is None
    with pytest.raises(NotFound):
        tenant.runs.get("brief-run")
    # The other agent has no TTL of its own and its tenant none per kind: everything of it stays.
    assert [e.content for e in tenant.events.list(Scope.session("keeper", "ada", "s1"))] == ["keeper chat"]
    assert tenant.state.get(Scope.for_user("keeper", "ada"), "pref").value == "tea"
    assert tenant.runs.get("keeper-run").id == "keeper-run"
    assert tenant.retention.agents() == {"brief": 60}
    assert tenant.retention.get() == DEFAULT_TTLS  # per-kind settings are not mixed with per-agent ones


def test_the_shorter_of_kind_and_agent_ttl_wins(tenant: TenantStore) -> None:
    S = Scope.session("brief", "ada", "s1")
    tenant.events.append(S, "message", "written before any policy")  # existing scopes are re-derived
    tenant.retention.set("session", 600)
    tenant.retention.set_agent("brief", 3600)  # looser than the kind's: the kind's 600 s still applies
    assert tenant.sweep(now=time.time() + 300).scopes == 0
    assert tenant.sweep(now=time.time() + 900).scopes == 1
    tenant.events.append(S, "message", "again")
    tenant.retention.set_agent("brief", 60)  # tighter than the kind's: the agent's applies
    assert tenant.sweep(now=time.time() + 120).scopes == 1
    tenant.events.append(S, "message", "and again")
    tenant.retention.set("session", 7200)  # loosening the kind keeps the agent's tighter TTL
    assert tenant.sweep(now=time.time() + 120).scopes == 1
    tenant.events.append(S, "message", "kept")
    tenant.retention.set_agent("brief", None)  # cleared: only the kind's TTL is left
    assert tenant.retention.agents() == {}
    assert tenant.sweep(now=time.time() + 3600).scopes == 0
    assert [e.content for e in tenant.events.list(S)] == ["kept"]


def test_agent_ttl_is_validated(tenant: TenantStore) -> None:
    for bad in (0, -5, True, "60"):
        with pytest.raises(InvalidInput):
            tenant.retention.set_agent("brief", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        tenant.retention.set_agent("bad agent/", 60)
