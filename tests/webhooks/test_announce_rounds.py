"""A round of the webhook announcer costs what it has to say, not what it has said: turns waiting days for a human
answer (announced ``waiting`` once) stay unsettled, and each round read every one's run, one query each, and sorted
them all for every page of 200 (2 to 4 s a round on SQLite with 10,000 of them; a round runs every half second)."""

from __future__ import annotations

import pytest

from moorage.store import Store, TenantStore
from moorage.store.model import Scope
from moorage.webhooks.delivery import announce
from tests.store.test_query_plans import other_users, plan, recorded, whole_table_reads

WAITING = 210  # more than a page of the announcer's reads


def _execution(ts: TenantStore, name: str, run_status: str | None, *, announced: str | None = None) -> None:
    ex, _ = ts.executions.create(name, "echo", f"user-{name}", "default", {"message": "later"})
    if run_status is not None:
        run = ts.runs.create(Scope("workflow", "echo", f"user-{name}", name), "turn", {"message": "later"}, run_id=name)
        ts.runs.update(run.id, expected_version=run.version, status=run_status)
    if announced is not None:
        assert ts.executions.mark_announced(name, announced, expected_version=ex.version)


def test_a_round_reads_only_the_executions_with_something_to_announce(store: Store, tenant: TenantStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hook = tenant.webhooks.create("echo", "https://example.com/hook")
    for i in range(WAITING):
        _execution(tenant, f"wait{i:04d}", "waiting", announced="waiting")
    _execution(tenant, "running", "running")
    _execution(tenant, "queued", None)
    _execution(tenant, "refused", None)
    tenant.executions.add_events("refused", [{"kind": "error", "data": {"type": "over-cap", "detail": "over the cap"}}])
    _execution(tenant, "done", "succeeded")
    _execution(tenant, "answered", "succeeded", announced="waiting")  # its human answered: it ended since

    with recorded(monkeypatch) as seen:
        assert announce(tenant) == 3
    # Not one statement per unsettled execution: a read of those with something to say, then each one's own.
    assert len(seen) < 40, f"{len(seen)} statements for {WAITING + 5} unsettled executions"
    events = {(d.event, d.payload["data"]["execution_id"], d.payload["data"]["status"])
              for d in tenant.deliveries.list(hook.id, limit=100)}
    assert events == {("execution.succeeded", "done", "succeeded"), ("execution.succeeded", "answered", "succeeded"),
                      ("execution.failed", "refused", "failed")}

    with recorded(monkeypatch) as seen:
        assert announce(tenant) == 0  # said once
    assert len(seen) < 5, f"{len(seen)} statements for a round with nothing to say"
    left = {e.id for e in tenant.executions.unsettled(limit=1000)}
    assert left == {f"wait{i:04d}" for i in range(WAITING)} | {"running", "queued"}
    # What a host's start submits again (``ExecutionRunner.resubmit_orphans``): those with no run, read as such.
    assert {ex.id for ex, run in tenant.executions.unsettled_to_act_on(())} == {"queued"}


def test_the_announcers_read_walks_only_the_unsettled_executions(store: Store, tenant: TenantStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its one read a page goes through the index on ``announced`` and each run by its id, never every execution or
    run kept (it may sort those it read, the unsettled ones with something to say)."""
    other_users(store, tenant)
    with recorded(monkeypatch) as seen:
        list(tenant.executions.unsettled_to_act_on(("waiting", "succeeded")))
    (sql, params), = seen
    lines = plan(store, tenant, sql, params)
    assert [ln for ln in whole_table_reads(sql, lines) if "Sort" not in ln and "TEMP B-TREE" not in ln] == [], lines
