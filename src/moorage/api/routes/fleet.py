"""The fleet at a glance, for the dashboard: instance counts by state, each instance with its last activity,
wake latency and (where this process has it open) RAM and disk, and an estimated cost split.

Read-only and tenant-scoped: everything comes from the caller's tenant store (sandbox rows, lifecycle spans,
the usage ledger) plus, for RAM/disk, the sandboxes this process's instance manager has open for that tenant.
``?agent=`` narrows all of it to one agent; a key limited to one agent must name its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.aio import within
from moorage.api import schemas as S
from moorage.api.pagination import parse_limit
from moorage.api.routes._common import agent_of_key, float_query
from moorage.api.routing import Call, Endpoint, Param
from moorage.cost.model import CostModel
from moorage.log import get_logger
from moorage.store import SandboxRecord, Span
from moorage.usage.ledger import totals as ledger_totals

log = get_logger(__name__)

#: States that hold compute (a sandbox process or VM exists and runs) versus those that only hold storage.
AWAKE_STATES = frozenset({"provisioning", "running", "waking", "suspending"})
ASLEEP_STATES = frozenset({"sleeping", "archived"})
#: How far back lifecycle spans are read. Spans share one table with request spans, so the window is a count,
#: and the figures derived from it (wake latency, awake/asleep seconds) cover at most this much history.
SPAN_WINDOW = 5000
#: Per-instance stats calls are bounded so one wedged sandbox cannot hang the dashboard.
STATS_TIMEOUT_S = 2.0


@dataclass
class _Timeline:
    """One instance's lifecycle as seen in the span window: transitions and wake timings."""

    transitions: list[tuple[float, str, str]] = field(default_factory=list)  # (at, from, to)
    wake_ms: list[tuple[float, float]] = field(default_factory=list)  # (at, ms)


def _timelines(spans: list[Span]) -> dict[str, _Timeline]:
    out: dict[str, _Timeline] = {}
    for s in spans:
        if not s.name.startswith("lifecycle.") or s.end_ts is None:
            continue
        instance = s.attrs.get("instance")
        if not isinstance(instance, str):
            continue
        tl = out.setdefault(instance, _Timeline())
        frm, to = s.attrs.get("from"), s.attrs.get("to")
        if isinstance(to, str):
            tl.transitions.append((s.end_ts, frm if isinstance(frm, str) else "", to))
        # ``lifecycle.woke`` starts when the wake began (the manager passes its start time), so its length is
        # the wake latency a request waited through: restore plus marking the instance running.
        if s.name == "lifecycle.woke":
            tl.wake_ms.append((s.end_ts, max(0.0, (s.end_ts - s.start_ts) * 1000.0)))
    for tl in out.values():
        tl.transitions.sort()
        tl.wake_ms.sort()
    return out


def _seconds_by_kind(box: SandboxRecord, tl: _Timeline | None, since: float, now: float) -> tuple[float, float]:
    """Awake and asleep seconds of one instance within [since, now], walking its transitions.

    Before the first transition in the window the instance was in that transition's ``from`` state (or did not
    exist yet, when it is the provisioning one); after the last it is in its current state.
    """
    start = max(since, box.created_at)
    if start >= now:
        return 0.0, 0.0
    steps = [t for t in (tl.transitions if tl else []) if start < t[0] <= now]
    awake = asleep = 0.0
    state = steps[0][1] if steps else box.state
    cursor = start
    for at, _frm, to in steps:
        span_s = at - cursor
        if state in AWAKE_STATES:
            awake += span_s
        elif state in ASLEEP_STATES:
            asleep += span_s
        state, cursor = to, at
    tail = now - cursor
    if state in AWAKE_STATES:
        awake += tail
    elif state in ASLEEP_STATES:
        asleep += tail
    return awake, asleep


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    # Nearest-rank: always one of the observed values, never an interpolation that no request saw.
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _live_stats(call: Call, boxes: list[SandboxRecord]) -> dict[str, Any]:
    """RAM and disk of the instances this process has open; the rest stay unknown (None), never guessed."""
    instances = getattr(call.ctx.runtime, "instances", None)
    if instances is None:
        return {}
    ts = call.tenant
    out: dict[str, Any] = {}
    for box in boxes:
        if box.state not in AWAKE_STATES:
            continue
        live = instances.live(ts, box.scope)
        sandbox = getattr(live, "sandbox", None)
        if sandbox is None or getattr(live, "record_id", None) != box.id:
            continue
        try:
            out[box.id] = await within(sandbox.stats(), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a sandbox that cannot report is shown without numbers
            log.warning("fleet: sandbox stats unavailable", instance=box.id, error=type(e).__name__)
    return out


@dataclass
class _Fleet:
    counts: dict[str, int]
    shown: list[SandboxRecord]  # the most recently active first
    moving: list[SandboxRecord]  # the instances the span window shows transitions or wakes of
    awake: list[SandboxRecord]  # those running now (their running part is not metered yet)
    timelines: dict[str, _Timeline]
    still_asleep_s: float  # asleep seconds of the asleep instances not in ``moving``
    totals: dict[str, float]


def _collect(call: Call, agent: str | None, since: float, limit: int, now: float) -> _Fleet:
    """What the fleet view needs, read by the store: counts, the page of instances shown, and only the instances
    the figures need one by one (a read of every instance of a tenant of 50,000 users took seconds)."""
    ts = call.tenant
    # One agent's lifecycle spans (they are scoped to its instances): its window is not used up by other agents'.
    timelines = _timelines(ts.spans.recent(limit=SPAN_WINDOW, agent=agent))
    moving = [b for b in ts.sandboxes.get_many(list(timelines)) if agent is None or b.agent_id == agent]
    # The asleep instances whose window the spans do not show were asleep all of it: counted by the store, less
    # the moving ones, which are walked below as before.
    asleep_all = ts.sandboxes.seconds_in(sorted(ASLEEP_STATES), since, now, agent_id=agent)
    naive = sum(_seconds_by_kind(b, None, since, now)[1] for b in moving)
    return _Fleet(counts=ts.sandboxes.count_by_state(agent_id=agent),
                  shown=ts.sandboxes.most_recent(limit=limit, agent_id=agent), moving=moving,
                  awake=ts.sandboxes.list(states=["running", "suspending"], agent_id=agent, limit=100_000),
                  timelines=timelines, still_asleep_s=max(0.0, asleep_all - naive),
                  totals=ledger_totals(ts, since=since, agent=agent))  # disk and snapshot bytes as levels


async def fleet(call: Call) -> dict[str, Any]:
    now = time.time()
    since = float_query(call, "since")
    if since is None:
        since = now - 30 * 86400.0
    limit = parse_limit(call.query("limit") or "200")
    # A key limited to one agent names it and sees that agent's instances, wakes and costs only.
    agent = agent_of_key(call, "fleet")
    f = await run_in_threadpool(_collect, call, agent, since, limit, now)
    counts, timelines, totals = f.counts, f.timelines, f.totals
    stats = await _live_stats(call, f.shown)

    asleep_s = f.still_asleep_s
    all_wakes: list[float] = []
    for box in f.moving:
        tl = timelines.get(box.id)
        asleep_s += _seconds_by_kind(box, tl, since, now)[1]
        all_wakes += [ms for at, ms in (tl.wake_ms if tl else []) if at >= since]
    instances = []
    for box in f.shown:
        tl = timelines.get(box.id)
        st = stats.get(box.id)
        wakes = [ms for at, ms in (tl.wake_ms if tl else []) if at >= since]
        instances.append({
            **S.sandbox(box), "user": box.scope.user,
            "session": box.scope.ref if box.scope.kind == "session" else None,
            "awake": box.state in AWAKE_STATES,
            "wakes": len(wakes), "last_wake_ms": round(wakes[-1], 1) if wakes else None,
            "ram_bytes": st.host_rss_bytes if st is not None else None,
            "disk_bytes": (st.disk_bytes + st.snapshot_bytes + st.checkpoint_bytes) if st is not None else None,
        })
    total = sum(counts.values())

    # Awake seconds are metered: what the usage ledger recorded at each sleep, plus the running part of the
    # instances awake now (from their records). Asleep seconds are still read from the lifecycle span window.
    awake_s = float(totals.get("compute_seconds", 0.0))
    for box in f.awake:
        started = box.meta.get("awake_since")
        if box.state in ("running", "suspending") and isinstance(started, (int, float)):
            awake_s += max(0.0, now - max(started, since))
    # Costs are estimates, labelled as such: awake instance-seconds at the cost model's vCPU+RAM rate and asleep
    # instance-seconds at its snapshot-storage rate (default price table and instance profile, docs/cost.md).
    # Model (LLM) spend is not estimated: it is the ledger's measured cost_usd.
    model = CostModel()
    compute_usd = awake_s * model.awake_per_s
    storage_usd = asleep_s * model.asleep_per_s
    return {
        "generated_at": now,
        "since": since,
        "counts": counts,
        "total": total,
        "awake": sum(n for s, n in counts.items() if s in AWAKE_STATES),
        "asleep": sum(n for s, n in counts.items() if s in ASLEEP_STATES),
        "instances": instances,
        "truncated": total > len(f.shown),
        "wake_ms": {"count": len(all_wakes), "p50": _round(_percentile(all_wakes, 0.5)),
                    "p95": _round(_percentile(all_wakes, 0.95)), "max": _round(max(all_wakes, default=None))},
        "cost": {
            "currency": model.prices.currency,
            # Not rounded: a small or idle fleet costs fractions of a micro-dollar, and the split must still show.
            "compute": compute_usd,
            "storage": storage_usd,
            "model": float(totals.get("cost_usd", 0.0)),
            "awake_s": round(awake_s, 3),
            "asleep_s": round(asleep_s, 3),
            "basis": "awake: metered; asleep: lifecycle spans; prices: default cost model",
        },
        "usage": totals,
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)



ENDPOINTS = [
    Endpoint("GET", "/v1/fleet", fleet, "Instances by state with activity, wake latency, RAM/disk and cost split",
             "sandboxes", "getFleet", scope="read", agent_checked=True,
             query=(Param("since", S.NUM, "seconds since the epoch (default: 30 days ago)"),
                    Param("agent", S.ID, "only this agent's instances and costs (a key limited to one agent must name it)"),
                    Param("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 200},
                          "most instances listed (most recently active first)")),
             response=S.obj({
                 "generated_at": S.NUM, "since": S.NUM,
                 "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                 "total": {"type": "integer"}, "awake": {"type": "integer"}, "asleep": {"type": "integer"},
                 # Each instance: its sandbox, whose user (and session) it is, and its wakes, RAM and disk
                 # (null where this process does not have it open).
                 "instances": {"type": "array", "items": S.obj({
                     **S.COMPONENTS["Sandbox"]["properties"], "user": S.NSTR, "session": S.NSTR,
                     "awake": {"type": "boolean"}, "wakes": S.INT, "last_wake_ms": S.NNUM,
                     "ram_bytes": {"type": ["integer", "null"]}, "disk_bytes": {"type": ["integer", "null"]}})},
                 "truncated": {"type": "boolean"},
                 "wake_ms": S.obj({"count": {"type": "integer"}, "p50": S.NNUM, "p95": S.NNUM,
                                   "max": S.NNUM}),
                 "cost": S.obj({"currency": S.STR, "compute": S.NUM, "storage": S.NUM, "model": S.NUM,
                                "awake_s": S.NUM, "asleep_s": S.NUM, "basis": S.STR}),
                 "usage": {"type": "object", "additionalProperties": S.NUM},
             })),
]
