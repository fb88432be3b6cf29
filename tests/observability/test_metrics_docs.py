"""docs/operations.md's "Metrics and alerts" names every metric a live host's ``/metrics`` shows, and nothing
it does not show: an operator writes alerts from that table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.observability.conftest import LiveHost

pytestmark = pytest.mark.timeout(240)

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
#: Shown only by a host that is a fleet member (the table says "fleet only").
FLEET_ONLY = {"moorage_fleet_heartbeat_age_seconds", "moorage_fleet_lease_ttl_seconds"}


def documented() -> set[str]:
    text = DOC.read_text()
    section = text.split("## Metrics and alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `moorage_")]
    return {name for ln in rows for name in re.findall(r"`(moorage_[a-z_]+)`", ln.split("|")[1])}


async def test_the_documented_metrics_are_the_ones_a_live_host_shows(live_host: LiveHost) -> None:
    token = (live_host.data_dir / "api" / "metrics-token").read_text().strip()
    async with live_host.client(token) as c:
        text = (await c.get("/metrics")).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    # prometheus_client's creation times (``_created``) are not shown: no alert reads them.
    assert [n for n in types if n.endswith("_created")] == []
    shown = set(types)
    doc = documented()
    assert doc - FLEET_ONLY - shown == set(), "documented but not on /metrics"
    assert shown - doc == set(), "on /metrics but not documented in docs/operations.md"
    assert FLEET_ONLY <= doc
