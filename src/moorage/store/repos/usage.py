"""The usage ledger: append-only amounts per kind (tokens, compute, storage, cost, wakes, byte levels),
summed for reports and budgets."""

from __future__ import annotations

import math
from typing import Any

from moorage.errors import InvalidInput
from moorage.store.model import Scope, UsageEntry
from moorage.store.repos.common import _now, _Repo
from moorage.store.sql import loads


USAGE_KINDS = ("input_tokens", "output_tokens", "cached_input_tokens", "compute_seconds", "storage_bytes", "cost_usd", "wakes",
               # Levels, not amounts: an instance's bytes at each sleep (read as gauges by moorage.usage.ledger).
               "disk_bytes", "snapshot_bytes", "checkpoint_bytes")


#: The latest time a ledger read looks at (the year 5138): a ``since`` past it, or before the epoch, holds nothing
#: there is not at its bound, and its day number must stay an integer the store can bind.
LATEST_TS = 1e11


def clamp_time(t: float) -> float:
    """``t`` within [0, ``LATEST_TS``]: what a query parameter such as ``since=-3.7e113`` may ask of the rollups'
    day numbers (it was an OverflowError, a 500)."""
    return min(max(float(t), 0.0), LATEST_TS)


class Usage(_Repo):
    """The usage ledger: append-only amounts per kind, summed for reports and budgets."""

    def add(self, kind: str, amount: float, *, agent_id: str | None = None, user_id: str | None = None,
            scope: Scope | None = None, meta: dict[str, Any] | None = None, ts: float | None = None) -> None:
        if kind not in USAGE_KINDS:
            raise InvalidInput(f"unknown usage kind {kind!r}", hint=f"one of {', '.join(USAGE_KINDS)}")
        row = (ts or _now(), kind, float(amount), agent_id, user_id, scope.key if scope else None, self._json(meta or {}))

        def insert() -> None:
            with self._ts._tx() as c:
                c.x("INSERT INTO usage (ts, kind, amount, agent_id, user_id, scope, meta) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    row)

        self._ts._retried(insert)  # its rollups' rows are shared with concurrent writers (store/usage_rollups.py)

    def totals(self, *, since: float | None = None, until: float | None = None, agent_id: str | None = None,
               user_id: str | None = None) -> dict[str, float]:
        """Each kind's sum over the rows of ``[since, until)`` (``until`` None: no end)."""
        since = clamp_time(since or 0.0)
        end = LATEST_TS + 86400.0 if until is None else clamp_time(until)
        if user_id is not None:  # a user's own rows, through their index (caps before each of their turns)
            where, params = "ts >= ? AND ts < ? AND user_id = ?", [since, end, user_id]
            if agent_id is not None:
                where += " AND agent_id = ?"
                params.append(agent_id)
            with self._ts._tx(write=False) as c:
                return {r[0]: float(r[1]) for r in c.q(f"SELECT kind, SUM(amount) FROM usage WHERE {where} GROUP BY kind",
                                                       params)}
        # A tenant's or an agent's: the rollups of the whole UTC days in the window (store migration 28), and the
        # ledger rows of the parts of a day before the first of them and after the last.
        first, last = math.ceil(since / 86400), math.floor(end / 86400)
        agent = "" if agent_id is None else " AND agent_id = ?"
        extra = [] if agent_id is None else [agent_id]
        out: dict[str, float] = {}
        with self._ts._tx(write=False) as c:
            if first >= last:  # no whole day: the window's rows
                edges = [(since, end)] if since < end else []
                rows = []
            else:
                edges = [(a, b) for a, b in ((since, first * 86400.0), (last * 86400.0, end)) if a < b]
                rows = c.q(f"SELECT kind, SUM(amount) FROM usage_days WHERE day >= ? AND day < ?{agent} GROUP BY kind",
                           [first, last, *extra])
            for a, b in edges:
                rows += c.q(f"SELECT kind, SUM(amount) FROM usage WHERE ts >= ? AND ts < ?{agent} GROUP BY kind",
                            [a, b, *extra])
        for kind, amount in rows:
            out[kind] = out.get(kind, 0.0) + float(amount)
        return out

    def entries(self, *, limit: int = 100) -> list[UsageEntry]:
        with self._ts._tx(write=False) as c:
            rows = c.q("SELECT id, ts, kind, amount, agent_id, user_id, meta FROM usage ORDER BY id DESC LIMIT ?", (limit,))
        return [UsageEntry(int(r[0]), r[1], r[2], r[3], r[4], r[5], loads(r[6])) for r in rows]
