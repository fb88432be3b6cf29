"""Caps per end-user of an agent: compute seconds per day, model tokens and cost per month (UTC windows); the
store's ``store_mib``, a level the agent's calls are held to as they write, is usage/store_cap.py's.

Consumption comes from the tenant's usage ledger (awake seconds are recorded as each instance sleeps, plus the
running part of an instance awake now, from its record); a turn over a cap is refused with ``CapExceeded``
(HTTP 429 naming the cap and when it resets), and an instance over its compute cap is put to sleep.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

from moorage.errors import MoorageError
from moorage.log import FailingRounds, get_logger
from moorage.store import EntityKey, Scope, TenantStore

log = get_logger(__name__)

#: Instance states that hold compute (their awake seconds are still running).
AWAKE_STATES = ("running", "suspending")
#: How often awake instances are checked against their users' compute caps.
ENFORCE_EVERY_S = 5.0


class CapExceeded(MoorageError):
    """An end-user reached one of their caps; nothing was started. Retry after the cap resets."""

    code = "cap-exceeded"
    http_status = 429

    def __init__(self, agent: str, user: str, cap: str, limit: float, used: float, resets_at: float,
                 now: float) -> None:
        when = datetime.fromtimestamp(resets_at, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        super().__init__(f"user {user!r} of agent {agent!r} reached the cap {cap} ({used:.6g} of {limit:.6g})",
                         hint=f"it resets at {when}; raise it with PUT /v1/agents/{agent}/users/{user} (limits)")
        self.cap = cap
        self.limit = limit
        self.used = used
        self.resets_at = resets_at
        #: Read by the API's problem+json: the ``Retry-After`` header says when the cap resets.
        self.retry_after = max(1.0, resets_at - now)


def day_window(now: float) -> tuple[float, float]:
    d = datetime.fromtimestamp(now, tz=timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    start = d.timestamp()
    return start, start + 86400.0


def month_window(now: float) -> tuple[float, float]:
    d = datetime.fromtimestamp(now, tz=timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = d.replace(year=d.year + 1, month=1) if d.month == 12 else d.replace(month=d.month + 1)
    return d.timestamp(), nxt.timestamp()


def _awake_now(ts: TenantStore, agent: str, user: str, since: float, now: float) -> float:
    """Seconds the user's instances awake right now have run since ``since`` (not yet in the ledger)."""
    rec = ts.sandboxes.for_scope(Scope.for_user(agent, user))
    recs = [rec] if rec is not None else [r for r in ts.sandboxes.list(agent_id=agent, states=list(AWAKE_STATES))
                                          if r.scope.user == user]
    total = 0.0
    for r in recs:
        started = r.meta.get("awake_since")
        if r.state in AWAKE_STATES and isinstance(started, (int, float)):
            total += max(0.0, now - max(started, since))
    return total


def compute_seconds(ts: TenantStore, agent: str, user: str, *, since: float, now: float | None = None) -> float:
    """Awake seconds of ``user``'s instances of ``agent`` since ``since``: recorded plus still running."""
    now = time.time() if now is None else now
    recorded = ts.usage.totals(since=since, agent_id=agent, user_id=user).get("compute_seconds", 0.0)
    return recorded + _awake_now(ts, agent, user, since, now)


def agent_limits(ts: TenantStore, agent: str) -> dict[str, float]:
    """The per-user limits an agent's live deployment sets for all its users (``[agent.limits]``)."""
    from moorage.errors import NotFound
    from moorage.store.agent_users import check_limits

    try:
        a = ts.agents.get(agent)
        if a.live_deployment is None:
            return {}
        raw = (ts.deployments.get(a.live_deployment).manifest or {}).get("limits") or {}
    except NotFound:
        return {}
    # turn_timeout_s bounds each turn of the agent (runtime/turn_execution.py): not a per-user cap
    return check_limits({k: v for k, v in raw.items() if k != "turn_timeout_s"})


def limits_of(ts: TenantStore, agent: str, user: str) -> dict[str, float]:
    """The user's effective limits: the agent's ``[agent.limits]``, overridden by the user's own."""
    u = ts.agent_users.find(agent, user)
    return {**agent_limits(ts, agent), **(u.limits if u is not None else {})}


def standing(ts: TenantStore, agent: str, user: str, *, now: float | None = None,
             store_ceiling: float | None = None) -> dict[str, dict[str, float | None]]:
    """Each of the user's effective caps (the agent's ``[agent.limits]`` and the user's own): ``limit``, ``used``
    as ``check`` counts it (the compute cap includes the running part of an instance awake now) and ``resets_at``.
    ``store_ceiling`` (the operator's ``user_max_store_mib``): with ``store_mib``, a level measured now (it reads
    the user's rows; ``resets_at`` None), which a turn's calls are held to as they write (usage/store_cap.py),
    not the check before a turn."""
    from moorage.usage.store_cap import under_ceiling

    now = time.time() if now is None else now
    limits = limits_of(ts, agent, user)
    out: dict[str, dict[str, float | None]] = {}
    store_cap = None if store_ceiling is None else under_ceiling(limits.get("store_mib"), store_ceiling)
    if store_cap is not None:
        used = sum(ts.footprint.user_bytes(agent, user).values()) / (1 << 20)
        out["store_mib"] = {"limit": store_cap, "used": used, "resets_at": None}
    cap = limits.get("compute_seconds_per_day")
    if cap is not None:
        start, end = day_window(now)
        out["compute_seconds_per_day"] = {"limit": cap, "used": compute_seconds(ts, agent, user, since=start, now=now),
                                          "resets_at": end}
    if "tokens_per_month" in limits or "cost_usd_per_month" in limits:
        start, end = month_window(now)
        totals = ts.usage.totals(since=start, agent_id=agent, user_id=user)
        tokens = totals.get("input_tokens", 0.0) + totals.get("output_tokens", 0.0)
        for name, used in (("tokens_per_month", tokens), ("cost_usd_per_month", totals.get("cost_usd", 0.0))):
            if name in limits:
                out[name] = {"limit": limits[name], "used": used, "resets_at": end}
    return out


def check(ts: TenantStore, agent: str, user: str, *, now: float | None = None) -> None:
    """Raise ``CapExceeded`` for the first of the user's caps that is used up (nothing when none is set)."""
    now = time.time() if now is None else now
    for name, c in standing(ts, agent, user, now=now).items():
        if c["used"] >= c["limit"]:  # type: ignore[operator]
            raise CapExceeded(agent, user, name, c["limit"], c["used"], c["resets_at"], now)  # type: ignore[arg-type]


#: The window of an operator's per-tenant ``tokens_per_month`` (the LLM policy's; see llm/policy.py).
TENANT_BUDGET_WINDOW_S = 30 * 86400.0


class TenantBudgetExceeded(MoorageError):
    """The tenant used up the operator's ``tokens_per_month`` across the fleet; nothing was started."""

    code = "budget-exceeded"
    http_status = 429

    def __init__(self, limit: float, used: float, retry_after: float) -> None:
        super().__init__(f"this tenant reached the cap tokens_per_month of its LLM policy ({used:.6g} of {limit:.6g} "
                         "tokens in the last 30 days, counted on every host)",
                         hint="retry when older usage leaves the window, or ask the operator to raise the budget")
        self.cap = "tokens_per_month"
        self.limit = limit
        self.used = used
        #: Read by the API's problem+json: when the oldest counted usage leaves the 30-day window.
        self.retry_after = max(1.0, retry_after)


def tenant_token_budget(runtime: Any, tenant_id: str) -> float | None:
    """The operator's ``tokens_per_month`` for this tenant (None: no policy or no budget)."""
    policy = getattr(getattr(runtime, "llm", None), "policy", None)
    if policy is None:
        return None
    limit = policy(tenant_id).tokens_per_month
    return float(limit) if limit else None


def check_tenant_budget(ts: TenantStore, limit: float, *, now: float | None = None) -> None:
    """Raise ``TenantBudgetExceeded`` when the tenant's model tokens in the ledger over the last 30 days reach
    ``limit``. The ledger is the shared store, so this counts every host's calls (the gateway's own budget is
    per host process)."""
    now = time.time() if now is None else now
    since = now - TENANT_BUDGET_WINDOW_S
    totals = ts.usage.totals(since=since)
    used = totals.get("input_tokens", 0.0) + totals.get("output_tokens", 0.0)
    if used < limit:
        return
    oldest = ts.read("SELECT MIN(ts) FROM usage WHERE ts >= ? AND kind IN ('input_tokens', 'output_tokens')", [since])
    first = float(oldest[0][0]) if oldest and oldest[0][0] is not None else now
    raise TenantBudgetExceeded(limit, used, first + TENANT_BUDGET_WINDOW_S - now)


async def enforce(runtime: Any, ts: TenantStore, entity: EntityKey) -> None:
    """Before a turn: refuse it if the user is over a cap, or the tenant over its LLM budget (fleet-wide, from
    the ledger); over the compute cap, the user's instance also sleeps."""
    budget = tenant_token_budget(runtime, ts.tenant_id)
    if budget is not None:
        await asyncio.to_thread(check_tenant_budget, ts, budget)
    try:
        await asyncio.to_thread(check, ts, entity.agent, entity.user)
    except CapExceeded as e:
        if e.cap == "compute_seconds_per_day" and runtime is not None:
            await runtime.instances.sleep(ts, Scope.for_user(entity.agent, entity.user), reason="compute cap reached")
        raise


async def enforce_loop(runtime: Any, *, every_s: float = ENFORCE_EVERY_S) -> None:
    """Put to sleep every instance this host keeps awake whose user is over the compute cap."""
    manager = runtime.instances
    failures = FailingRounds(log, "cap enforcement round")
    while True:
        try:
            for awake in manager.awake_instances():
                tenant_id, _, scope_key = awake.instance_id.partition("/")
                scope = Scope.parse(scope_key)
                if scope.user is None:
                    continue
                ts = manager.system_tenant(tenant_id)
                try:
                    await asyncio.to_thread(check, ts, scope.agent, scope.user)
                except CapExceeded as e:
                    if e.cap == "compute_seconds_per_day" and await manager.sleep(ts, scope, reason="compute cap reached"):
                        log.info("instance slept: its user reached the compute cap", scope=scope_key)
            failures.ok()
        except Exception as e:  # noqa: BLE001 - the loop must outlive a bad round
            failures.failed(e)
        await asyncio.sleep(every_s)
