"""The public langgraph-checkpoint-conformance suite against MoorageSaver on SQLite and a real PostgreSQL cluster.

Every capability (base and extended) must be detected and pass on both backends.
"""

from __future__ import annotations

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from moorage.store import TenantStore
from moorage.store.langgraph import MoorageSaver


async def test_conformance_full(tenant: TenantStore) -> None:
    @checkpointer_test(name=f"MoorageSaver[{tenant.dialect}]")
    async def moorage_saver():
        yield MoorageSaver(tenant)

    report = await validate(moorage_saver, progress=ProgressCallbacks.verbose())
    report.print_report()
    failures = [f for r in report.results.values() for f in r.failures]
    assert report.passed_all(), failures
    # Every capability, extended ones included, is implemented and was exercised.
    assert {c.value for c in ALL_CAPABILITIES} == {k for k, r in report.results.items() if r.detected and r.passed}
    assert report.conformance_level() == "FULL"
