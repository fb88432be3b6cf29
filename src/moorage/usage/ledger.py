"""Usage totals by UTC day (per tenant, optionally one agent and end-user), read from the usage ledger, and the
storage an instance holds (disk, snapshot and checkpoint bytes, measured at each sleep) as levels rather than sums."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Any

from moorage.log import get_logger
from moorage.store import TenantStore
from moorage.store import usage_rollups
from moorage.store.repos.usage import clamp_time

log = get_logger(__name__)

#: Ledger kinds that are levels (disk, snapshot and checkpoint bytes; the store's rollup triggers keep them): each
#: row is an instance's bytes at one sleep. A day shows, per instance, its value at its last sleep that day, summed
#: over instances; totals show each instance's latest value, summed.
GAUGES = usage_rollups.GAUGES


def _where(since: float, until: float | None, agent: str | None, user: str | None) -> tuple[str, list[Any]]:
    where, params = "ts >= ? AND ts < ?", [since, until if until is not None else time.time() + 86400.0]
    if agent is not None:
        where += " AND agent_id = ?"
        params.append(agent)
    if user is not None:
        where += " AND user_id = ?"
        params.append(user)
    return where, params


def _edges(since: float, until: float) -> tuple[int, int, list[tuple[float, float]]]:
    """The whole UTC days in ``[since, until)`` (``first`` to ``last``, exclusive), and the parts of a day before
    and after them: the rollups answer the days, the ledger (or an instance's level rows) the parts."""
    since, until = clamp_time(since), clamp_time(until)
    first, last = math.ceil(since / 86400), math.floor(until / 86400)
    return first, last, [(a, b) for a, b in ((since, first * 86400.0), (last * 86400.0, until)) if a < b]


def by_day(ts: TenantStore, *, since: float, until: float | None = None, agent: str | None = None,
           user: str | None = None) -> list[dict[str, object]]:
    """``[{"day": "YYYY-MM-DD", "totals": {kind: amount}}]``, oldest first, days with usage only."""
    bucket = "FLOOR(ts / 86400)" if ts.dialect == "postgres" else "CAST(ts / 86400 AS INTEGER)"
    where, params = _where(since, until, agent, user)
    gauges = ", ".join("?" for _ in GAUGES)
    sums = f"SELECT {bucket} AS d, kind, SUM(amount) FROM usage WHERE {{}} AND kind NOT IN ({gauges}) GROUP BY d, kind"
    first, last, edges = _edges(since, params[1])
    if user is not None or first >= last:  # a user's rows through their index; a window inside a day or two
        rows, edges = ts.read(sums.format(where), [*params, *GAUGES]), [(since, params[1])]
    else:  # whole days from the rollups (store migration 28), the ledger for the parts of a day at either end
        rows = []
        for start, end in edges:
            edge, edge_params = _where(start, end, agent, None)
            rows += ts.read(sums.format(edge), [*edge_params, *GAUGES])
        agent_sql = "" if agent is None else " AND agent_id = ?"
        rows += ts.read(f"SELECT day, kind, SUM(amount) FROM usage_days WHERE day >= ? AND day < ?{agent_sql} "
                        f"AND kind NOT IN ({gauges}) GROUP BY day, kind", [first, last, *params[2:], *GAUGES])
        # each day's last measurement of every instance, summed
        rows += ts.read(f"SELECT day, kind, SUM(amount) FROM usage_level_days WHERE latest = 0 AND day >= ? "
                        f"AND day < ?{agent_sql} GROUP BY day, kind", [first, last, *params[2:]])
    days: dict[int, dict[str, float]] = {}
    for d, kind, amount in rows:
        totals = days.setdefault(int(d), {})
        totals[kind] = totals.get(kind, 0.0) + float(amount)
    last_sleep: dict[tuple[int, str, str], float] = {}  # (day, kind, instance scope) -> bytes at its last sleep that day
    for start, end in edges:
        for at, kind, amount, scope in _gauge_rows(ts, *_where(start, end, agent, user)):
            last_sleep[(int(at // 86400), kind, scope)] = float(amount)
    for (d, kind, _), amount in last_sleep.items():
        totals = days.setdefault(d, {})
        totals[kind] = totals.get(kind, 0.0) + amount
    return [{"day": datetime.fromtimestamp(d * 86400, tz=timezone.utc).strftime("%Y-%m-%d"), "totals": totals}
            for d, totals in sorted(days.items())]


def storage(ts: TenantStore, *, since: float, until: float | None = None, agent: str | None = None,
            user: str | None = None) -> dict[str, float]:
    """Each gauge kind: the latest value of every instance that slept in ``[since, until)``, summed (with ``until``,
    each instance's last measurement before it, read from the window's ledger rows)."""
    where, params = _where(since, until, agent, user)
    out: dict[str, float] = {}
    if user is None and until is None:  # each instance's latest level, kept by the store (migration 28), summed per day
        first, last, edges = _edges(since, params[1])
        agent_sql = "" if agent is None else " AND agent_id = ?"
        rows = ts.read(f"SELECT kind, SUM(amount) FROM usage_level_days WHERE latest = 1 AND day >= ? AND day < ?"
                       f"{agent_sql} GROUP BY kind", [first, last, *params[2:]]) if first < last else []
        for start, end in edges if first < last else [(since, params[1])]:
            rows += ts.read(f"SELECT kind, SUM(amount) FROM usage_levels WHERE day = -1 AND ts >= ? AND ts < ?"
                            f"{agent_sql} GROUP BY kind", [start, end, *params[2:]])
        for kind, amount in rows:
            out[kind] = out.get(kind, 0.0) + float(amount)
        return out
    last_level: dict[tuple[str, str], float] = {}
    for _, kind, amount, scope in _gauge_rows(ts, where, params):
        last_level[(kind, scope)] = float(amount)
    for (kind, _), amount in last_level.items():
        out[kind] = out.get(kind, 0.0) + amount
    return out


def totals(ts: TenantStore, *, since: float, until: float | None = None, agent: str | None = None,
           user: str | None = None) -> dict[str, float]:
    """The ledger's totals over ``[since, until)``; disk and snapshot bytes as levels (each instance's latest,
    summed), not the sum of every sleep's measurement. What ``/v1/usage`` and ``/v1/fleet`` report."""
    out = ts.usage.totals(since=since, until=until, agent_id=agent, user_id=user)
    out.update(storage(ts, since=since, until=until, agent=agent, user=user))
    return out


def _gauge_rows(ts: TenantStore, where: str, params: list[Any]) -> list[tuple[float, str, float, str]]:
    gauges = ", ".join("?" for _ in GAUGES)
    rows = ts.read(f"SELECT ts, kind, amount, scope FROM usage WHERE {where} AND kind IN ({gauges}) ORDER BY ts, id",
                   [*params, *GAUGES])
    return [(float(r[0]), r[1], float(r[2]), r[3] or "") for r in rows]


async def measure(sandbox: Any) -> dict[str, int]:
    """A sandbox's disk, snapshot and checkpoint bytes for the ledger (nothing when the driver cannot tell)."""
    try:
        st = await sandbox.stats()
    except Exception as e:  # noqa: BLE001 - metering must never fail a sleep
        log.warning("could not measure a sandbox's storage", sandbox=getattr(sandbox, "id", None), error=str(e))
        return {}
    return {"disk_bytes": int(st.disk_bytes), "snapshot_bytes": int(st.snapshot_bytes),
            "checkpoint_bytes": int(st.checkpoint_bytes)}


def record(ts: TenantStore, rec: Any, sizes: dict[str, int]) -> None:
    """Write an instance's measured bytes (call inside the transaction that records its sleep)."""
    for kind, amount in sizes.items():
        ts.usage.add(kind, amount, agent_id=rec.scope.agent, user_id=rec.scope.user, scope=rec.scope,
                     meta={"instance": rec.id})
