"""TTLs of record kinds on both backends: the usage ledger's rows and finished executions are deleted once older
than their kind's TTL; an execution not yet announced, or a detached exec that may still run, is kept; the
ledger's TTL cannot be shorter than the longest cap window."""

from __future__ import annotations

import time

import pytest

from moorage.errors import InvalidInput, NotFound
from moorage.store import TenantStore
from moorage.store.model import Span
from moorage.store.repos.retention import DEFAULT_TTLS, EXEC_MAX_S, MIN_USAGE_TTL_S


def test_usage_rows_older_than_the_ttl_are_swept(tenant: TenantStore) -> None:
    now = time.time()
    tenant.usage.add("input_tokens", 5, agent_id="a", user_id="u", ts=now - MIN_USAGE_TTL_S - 60)
    tenant.usage.add("input_tokens", 7, agent_id="a", user_id="u", ts=now - 60)
    tenant.sweep(now=now)
    assert tenant.usage.totals(agent_id="a")["input_tokens"] == 12  # no TTL set: the ledger is kept
    with pytest.raises(InvalidInput, match="31 days"):
        tenant.retention.set("usage", 86400)
    tenant.retention.set("usage", MIN_USAGE_TTL_S)
    assert tenant.retention.get() == {**DEFAULT_TTLS, "usage": MIN_USAGE_TTL_S}
    assert tenant.sweep(now=now).rows >= 1
    assert tenant.usage.totals(agent_id="a")["input_tokens"] == 7
    with pytest.raises(InvalidInput, match="unknown retention kind"):
        tenant.retention.set("events", 60)


def test_finished_executions_older_than_the_ttl_are_swept(tenant: TenantStore) -> None:
    for name in ("done", "open", "execjob"):
        tenant.executions.create(name, "a", "u", "default", {"message": name})
    for name, status in (("done", "succeeded"), ("execjob", "exec")):
        tenant.executions.mark_announced(name, status, expected_version=tenant.executions.get(name).version)
    tenant.retention.set("executions", 3600)
    now = time.time()
    tenant.sweep(now=now + 60)
    assert {n: _exists(tenant, n) for n in ("done", "open", "execjob")} == dict.fromkeys(("done", "open", "execjob"), True)
    tenant.sweep(now=now + 3700)  # the announced turn's record is old enough; the open one is kept
    assert _exists(tenant, "done") is False and _exists(tenant, "open") and _exists(tenant, "execjob")
    tenant.sweep(now=now + 3700 + EXEC_MAX_S)  # a detached exec goes once it cannot be running any more
    assert _exists(tenant, "execjob") is False and _exists(tenant, "open")


def test_traces_and_webhooks_have_a_ttl_of_30_days_unless_the_tenant_keeps_them(tenant: TenantStore) -> None:
    """A tenant that never set a TTL for traces kept every span for ever: each HTTP request writes one, so a
    default host's store grew without bound. Never set, traces and webhooks go after 30 days; set to null, kept."""
    assert tenant.retention.get() == {"traces": 30 * 86400.0, "webhooks": 30 * 86400.0}
    now = time.time()
    for trace, age in (("t-old", 31 * 86400), ("t-new", 29 * 86400)):
        tenant.spans.record(Span(trace, f"s-{trace}", None, "http.request", now - age, now - age + 0.01, "ok", {}))
    tenant.sweep(now=now)
    assert {s.trace_id for s in tenant.spans.recent(limit=10)} == {"t-new"}
    tenant.retention.set("traces", None)  # kept for ever, as asked
    assert tenant.retention.get()["traces"] is None
    tenant.sweep(now=now + 60 * 86400)
    assert {s.trace_id for s in tenant.spans.recent(limit=10)} == {"t-new"}


def _exists(tenant: TenantStore, execution_id: str) -> bool:
    try:
        tenant.executions.get(execution_id)
    except NotFound:
        return False
    return True


def test_a_scope_its_ttl_sweeps_keeps_its_usage_rows_and_a_forgotten_user_s_stay_unnamed(tenant: TenantStore) -> None:
    """Usage billed already stays in the tenant's totals: the TTL sweep of an idle scope deleted the scope's ledger
    rows (an instance's awake seconds, wakes, storage) and forgetting a user deleted all of theirs, so a month
    already invoiced read less afterwards. The sweep keeps them; a forget keeps them without the user's name."""
    from moorage.store import Scope
    from moorage.usage import ledger

    scope = Scope.session("a", "u", "s1")
    tenant.retention.set("session", 60)
    tenant.state.put(scope, "k", 1, expected_version=0)
    tenant.usage.add("compute_seconds", 12.5, agent_id="a", user_id="u", scope=scope, meta={"instance": "i-1"})
    tenant.usage.add("disk_bytes", 4096, agent_id="a", user_id="u", scope=scope, meta={"instance": "i-1"})
    tenant.usage.add("input_tokens", 100, agent_id="a", user_id="u", meta={"trace_id": "t"})
    tenant.usage.add("input_tokens", 5, agent_id="a", user_id="v")
    billed = ledger.totals(tenant, since=0.0)
    assert billed == {"compute_seconds": 12.5, "disk_bytes": 4096.0, "input_tokens": 105.0}
    assert tenant.sweep(now=time.time() + 120).scopes == 1
    assert ledger.totals(tenant, since=0.0) == billed
    assert ledger.totals(tenant, since=0.0, user="u")["compute_seconds"] == 12.5  # the user is still there

    tenant.forget_user("u", "a")
    assert ledger.totals(tenant, since=0.0) == billed == ledger.totals(tenant, since=0.0, agent="a")
    assert ledger.by_day(tenant, since=0.0)[0]["totals"] == billed
    assert ledger.totals(tenant, since=0.0, user="u") == {}
    assert ledger.totals(tenant, since=0.0, user="v") == {"input_tokens": 5.0}
    kept = tenant.read("SELECT user_id, scope, meta FROM usage WHERE amount <> 5 ORDER BY id")
    assert len(kept) == 3 and all(r[0] is None and "u" not in (r[1] or "") and "i-1" not in str(r[2]) and
                                  "trace" not in str(r[2]) for r in kept), kept
