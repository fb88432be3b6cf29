"""Time to live per scope kind and per agent, and the re-derivation of every scope's expiry when a
policy changes (the sweeper deletes what has expired); TTLs of record kinds (executions, the usage ledger,
traces)."""

from __future__ import annotations

from moorage.errors import InvalidInput
from moorage.store import usage_rollups
from moorage.store.model import SCOPE_KINDS, check_id
from moorage.store.repos.common import SWEEP_BATCH, _Repo

#: Kinds of record with a TTL of their own, counted from the record's last change (not a scope's idleness);
#: ``traces``: every span by its start, a turn's and an HTTP request's alike (a scope's also go with the scope).
RECORD_KINDS: tuple[str, ...] = ("executions", "usage", "traces", "webhooks")
#: Every kind a tenant-wide TTL can be set for.
RETENTION_KINDS: tuple[str, ...] = SCOPE_KINDS + RECORD_KINDS
#: The TTL of a record kind whose TTL the tenant never set (one set to null, None, is kept for ever): a host's
#: request traces and delivered webhooks grow with every request served (a soak of 18 minutes left 21,000 spans),
#: so they are not kept for ever by default.
DEFAULT_TTLS: dict[str, float] = {"traces": 30 * 86400.0, "webhooks": 30 * 86400.0}
#: The ledger must cover the longest cap window (a calendar month; the LLM policy's 30 days), or caps undercount.
MIN_USAGE_TTL_S = 31 * 86400.0
#: A detached exec runs at most this long (runtime/exec_jobs.py MAX_TIMEOUT_S): its record is never swept sooner.
EXEC_MAX_S = 24 * 3600.0


class Retention(_Repo):
    """Time to live per scope kind and per agent; the sweeper deletes a scope's data once it has been idle
    for the shorter of its kind's and its agent's TTL."""

    def set(self, kind: str, ttl_s: float | None) -> None:
        """A scope kind's TTL (idle seconds), or a record kind's (seconds since the record last changed)."""
        if kind not in RETENTION_KINDS:
            raise InvalidInput(f"unknown retention kind {kind!r}", hint=f"one of {', '.join(RETENTION_KINDS)}")
        ttl_s = _check_ttl(ttl_s)
        if kind == "usage" and ttl_s is not None and ttl_s < MIN_USAGE_TTL_S:
            raise InvalidInput(f"the usage ledger's ttl_s must be at least {MIN_USAGE_TTL_S:g} s (31 days), not {ttl_s:g}",
                               hint="caps count a calendar month of usage; a shorter TTL would let users past them")
        self._put(kind, ttl_s)

    def sweep_records(self, now: float, *, batch: int | None = None) -> int:
        """Delete the records older than their kind's TTL (finished executions, usage rows), ``batch`` rows per
        transaction (``_delete_batched``); rows deleted."""
        with self._ts._tx(write=False) as c:
            rows = dict(c.q("SELECT kind, ttl_s FROM retention"))
        ttls = {k: v for k, v in ({**DEFAULT_TTLS, **rows}).items() if k in RECORD_KINDS and v is not None}
        n = 0
        if "usage" in ttls:
            n += self._sweep_usage(now - ttls["usage"], batch)
        if "executions" in ttls:
            cutoff = now - ttls["executions"]
            # Turn executions once their outcome is announced; detached execs once they cannot be running.
            n += self._delete_batched("executions", "id", "updated_at < ? AND (announced IN ('succeeded', 'failed', "
                                      "'cancelled') OR (announced = 'exec' AND created_at < ?))",
                                      (cutoff, cutoff - EXEC_MAX_S), batch)
        if "traces" in ttls:
            n += self._delete_batched("spans", "span_id", "start_ts < ?", (now - ttls["traces"],), batch)
        if "webhooks" in ttls:  # delivered or failed deliveries, with their attempts (pending ones still go out)
            n += self._ts.deliveries.sweep(now - ttls["webhooks"], batch=batch)
        return n

    def _sweep_usage(self, before: float, batch: int | None) -> int:
        """Delete the ledger rows written before ``before``, ``batch`` per transaction, each batch's agents locked
        first in one order (its rows span agents: store/usage_rollups.py); rows deleted."""
        n, size = 0, batch or SWEEP_BATCH
        key = usage_rollups.PG_AGENT_KEY if self._ts.dialect == "postgres" else "0"
        while True:
            with self._ts._tx() as c:
                rows = c.q(f"SELECT id, {key} FROM usage WHERE ts < ? LIMIT ?", (before, size))
                if rows:
                    if c.dialect == "postgres":
                        usage_rollups.take_agent_locks(c, [r[1] for r in rows])
                    n += c.x(f"DELETE FROM usage WHERE id IN ({','.join('?' * len(rows))})", [r[0] for r in rows])
            if len(rows) < size:
                return n

    def set_agent(self, agent: str, ttl_s: float | None) -> None:
        """Every scope of ``agent`` (sessions, users, workflows) is swept once idle ``ttl_s`` seconds, or sooner
        if its kind's TTL is shorter; None: the agent adds no limit of its own."""
        check_id(agent, "agent id")
        self._put(_AGENT_RETENTION + agent, _check_ttl(ttl_s))

    def _put(self, key: str, ttl_s: float | None) -> None:
        pk = "tenant_id, " if self._ts.dialect == "postgres" else ""
        with self._ts._tx() as c:
            if ttl_s is None and key.startswith(_AGENT_RETENTION):
                c.x("DELETE FROM retention WHERE kind = ?", (key,))
            else:
                c.x(f"INSERT INTO retention (kind, ttl_s) VALUES (?, ?) ON CONFLICT ({pk}kind) "
                    "DO UPDATE SET ttl_s = excluded.ttl_s", (key, ttl_s))
            # Re-derive the expiry of existing scopes so the new policy applies to them too: per kind, then
            # tightened for each agent with a shorter TTL of its own.
            rows = dict(c.q("SELECT kind, ttl_s FROM retention"))
            for kind in SCOPE_KINDS:
                ttl = rows.get(kind)
                if ttl is None:
                    c.x("UPDATE scopes SET expires_at = NULL WHERE kind = ?", (kind,))
                else:
                    c.x("UPDATE scopes SET expires_at = last_active + ? WHERE kind = ?", (ttl, kind))
                for name, agent_ttl in rows.items():
                    if name.startswith(_AGENT_RETENTION) and agent_ttl is not None and (ttl is None or agent_ttl < ttl):
                        c.x("UPDATE scopes SET expires_at = last_active + ? WHERE kind = ? AND agent_id = ?",
                            (agent_ttl, kind, name[len(_AGENT_RETENTION):]))

    def get(self) -> dict[str, float | None]:
        """TTL per scope kind and record kind: those ever set, and the defaults of those never set."""
        with self._ts._tx(write=False) as c:
            return {**DEFAULT_TTLS, **{r[0]: r[1] for r in c.q("SELECT kind, ttl_s FROM retention")
                                       if not r[0].startswith(_AGENT_RETENTION)}}

    def agents(self) -> dict[str, float]:
        """TTL per agent that has one of its own."""
        with self._ts._tx(write=False) as c:
            return {r[0][len(_AGENT_RETENTION):]: r[1] for r in c.q("SELECT kind, ttl_s FROM retention")
                    if r[0].startswith(_AGENT_RETENTION) and r[1] is not None}


#: Rows of the retention table keyed by this prefix and an agent id hold that agent's own TTL (kinds never
#: contain a colon, so the two cannot collide).
_AGENT_RETENTION = "agent:"


def _check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
        raise InvalidInput(f"ttl_s must be a positive number of seconds, not {ttl_s!r}",
                           hint="give the idle seconds after which data is deleted, or null (None) to keep it forever")
    return ttl_s
