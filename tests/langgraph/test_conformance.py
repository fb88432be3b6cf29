"""The public langgraph-checkpoint-conformance suite against the guest's ``MoorageCheckpointer`` and the host's
``graph.*`` calls on both store backends: the saver's host calls go straight to the host handlers with a turn's
binding (the hop the channel adds is covered end to end in test_guest_graph.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from moorage.guest.langgraph_saver import MoorageCheckpointer  # in the sandbox: guest.langgraph_saver
from moorage.runtime.graph_calls import GraphCalls
from moorage.store import EntityKey, Scope, TenantStore


class _Host:
    """What ``ctx._host`` is in the sandbox, minus the channel: each call is served by the host's handler."""

    def __init__(self, ts: TenantStore, user: str) -> None:
        self.handlers = GraphCalls().methods()
        self.binding = SimpleNamespace(ts=ts, entity=EntityKey("agent", user), user_scope=Scope.for_user("agent", user))

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        return await self.handlers[method](self.binding, params)  # type: ignore[arg-type]


async def test_conformance(tenant: TenantStore) -> None:
    @checkpointer_test(name=f"MoorageCheckpointer[{tenant.dialect}]")
    async def guest_saver():
        yield MoorageCheckpointer(SimpleNamespace(_host=_Host(tenant, "ada")))

    report = await validate(guest_saver, progress=ProgressCallbacks.verbose())
    report.print_report()
    failures = [f for r in report.results.values() for f in r.failures]
    assert report.passed_all(), failures
    # Every base capability is implemented and passed (the extended ones, copy_thread, delete_for_runs and
    # prune, are not: moorage's own fork and retention do that for the whole instance).
    assert {"put", "put_writes", "get_tuple", "list", "delete_thread"} <= {
        k for k, r in report.results.items() if r.detected and r.passed}
