"""Usage totals by UTC day (per tenant, optionally one agent and end-user), read from the usage ledger."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from moorage.store import TenantStore


def by_day(ts: TenantStore, *, since: float, until: float | None = None, agent: str | None = None,
           user: str | None = None) -> list[dict[str, object]]:
    """``[{"day": "YYYY-MM-DD", "totals": {kind: amount}}]``, oldest first, days with usage only."""
    bucket = "FLOOR(ts / 86400)" if ts.dialect == "postgres" else "CAST(ts / 86400 AS INTEGER)"
    where, params = "ts >= ? AND ts < ?", [since, until if until is not None else time.time() + 86400.0]
    if agent is not None:
        where += " AND agent_id = ?"
        params.append(agent)
    if user is not None:
        where += " AND user_id = ?"
        params.append(user)
    rows = ts.read(f"SELECT {bucket} AS d, kind, SUM(amount) FROM usage WHERE {where} GROUP BY d, kind ORDER BY d",
                   params)
    days: dict[int, dict[str, float]] = {}
    for d, kind, amount in rows:
        days.setdefault(int(d), {})[kind] = float(amount)
    return [{"day": datetime.fromtimestamp(d * 86400, tz=timezone.utc).strftime("%Y-%m-%d"), "totals": totals}
            for d, totals in sorted(days.items())]
