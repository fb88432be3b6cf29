"""The policy simulator: replays an arrival trace through one sleep policy on a virtual clock.

Event-driven (arrivals merged with a heap of turn ends and policy rechecks), so a day of 1e5 turns takes seconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from moorage.cost.model import CostModel
from moorage.cost.trace import Trace
from moorage.errors import InvalidInput, MoorageError
from moorage.lifecycle.policies import Decision, InstanceActivity, SleepPolicy, WarmPool

Provisioning = Literal["fork", "cold-boot"]

_NEW, _AWAKE, _ASLEEP = 0, 1, 2
_END, _RECHECK = 0, 1


class PolicyContractError(MoorageError):
    """A policy broke the ``SleepPolicy`` contract during a replay (a bug in that policy)."""

    code = "policy-contract"


@dataclass(frozen=True)
class SimSettings:
    #: How a brand-new agent gets its sandbox when the warm pool has none ready.
    provisioning: Provisioning = "fork"
    #: Pre-forked sandboxes kept running for new agents (0: fork on demand).
    warm_pool: int = 0

    def __post_init__(self) -> None:
        if self.provisioning not in ("fork", "cold-boot"):
            raise InvalidInput(f"unknown provisioning {self.provisioning!r}", hint="use fork or cold-boot")
        if self.warm_pool < 0:
            raise InvalidInput(f"warm pool size must be ≥ 0, got {self.warm_pool}")


@dataclass(frozen=True)
class PolicyResult:
    """What one policy cost on one trace. Seconds are instance-seconds summed over instances."""

    policy: str
    turns: int
    instances: int
    horizon_s: float
    #: Awake instance-seconds, sleep and wake operations included (warm pool excluded).
    compute_s: float
    #: Awake seconds of pre-forked warm-pool sandboxes.
    pool_compute_s: float
    awake_ram_gb_h: float
    #: Snapshot GB-hours while asleep.
    storage_gb_h: float
    wakes: int
    sleeps: int
    provisions: int
    #: Turns that waited for a wake or a provisioning.
    delayed_turns: int
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    latency_mean_s: float
    #: Added latency of first turns only: what provisioning (warm pool, fork, cold boot) costs a new user.
    provision_p50_s: float
    provision_p99_s: float
    #: The longest time any one instance stayed awake without sleeping.
    longest_awake_s: float
    cost_compute: float
    cost_storage: float
    cost_latency: float
    currency: str

    @property
    def cost_total(self) -> float:
        return self.cost_compute + self.cost_storage + self.cost_latency

    @property
    def wakes_per_turn(self) -> float:
        return self.wakes / self.turns if self.turns else 0.0

    @property
    def awake_share(self) -> float:
        """Compute seconds over instance-seconds of the replay: 1.0 is always-on from t=0."""
        return self.compute_s / (self.instances * self.horizon_s) if self.instances and self.horizon_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cost_total": self.cost_total, "wakes_per_turn": self.wakes_per_turn, "awake_share": self.awake_share}


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    k = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[k - 1]


class _Instance:
    __slots__ = ("activity", "state", "awake_since", "asleep_since", "ready_at", "gen")

    def __init__(self, activity: InstanceActivity) -> None:
        self.activity = activity
        self.state = _NEW
        self.awake_since = 0.0
        # While asleep: when the snapshot finished (a wake cannot start before it).
        self.asleep_since = 0.0
        # While awake: when the pending wake or provisioning completes.
        self.ready_at = 0.0
        # Bumped on every state change so a stale recheck is ignored.
        self.gen = 0


def simulate(trace: Trace, policy: SleepPolicy, model: CostModel | None = None, settings: SimSettings | None = None) -> PolicyResult:
    """Replay ``trace`` through ``policy``: every turn wakes (or provisions) its instance if needed, and after
    every turn end (and at each ``recheck_at``) the policy decides whether the instance sleeps."""
    model = model or CostModel()
    settings = settings or SimSettings()
    prof = model.instance
    prov_s = prof.fork_s if settings.provisioning == "fork" else prof.cold_boot_s
    pool = WarmPool(settings.warm_pool, refill_s=prov_s)
    horizon = trace.horizon_s

    insts: dict[str, _Instance] = {}
    heap: list[tuple[float, int, int, _Instance, int]] = []
    seq = 0
    latencies: list[float] = []
    provision_latencies: list[float] = []
    compute = storage = longest = 0.0
    wakes = sleeps = provisions = 0

    def decide(inst: _Instance, now: float) -> None:
        nonlocal seq, compute, longest, sleeps
        d: Decision = policy.decide(inst.activity, now)
        if d.sleep_now:
            done = now + prof.sleep_s
            stretch = done - inst.awake_since
            compute += stretch
            longest = max(longest, stretch)
            inst.state, inst.asleep_since = _ASLEEP, done
            inst.gen += 1
            sleeps += 1
        elif d.recheck_at is not None:
            if not d.recheck_at > now:
                raise PolicyContractError(
                    f"policy {policy.name} asked to recheck at {d.recheck_at} without sleeping at {now}",
                    hint="recheck_at must be later than now",
                )
            if d.recheck_at <= horizon:
                seq += 1
                heapq.heappush(heap, (d.recheck_at, seq, _RECHECK, inst, inst.gen))

    def handle(event: tuple[float, int, int, _Instance, int]) -> None:
        now, _, kind, inst, gen = event
        if kind == _END:
            inst.activity.turn_ended(now)
            if not inst.activity.busy:
                decide(inst, now)
        elif gen == inst.gen and inst.state == _AWAKE and not inst.activity.busy:
            decide(inst, now)

    turns = trace.turns
    i, n = 0, len(turns)
    while i < n or heap:
        # At equal times the arrival goes first: a request arriving as a timer fires finds its instance awake.
        if i < n and (not heap or turns[i].arrival_s <= heap[0][0]):
            turn = turns[i]
            i += 1
            now = turn.arrival_s
            inst = insts.get(turn.instance)
            if inst is None:
                inst = insts[turn.instance] = _Instance(InstanceActivity.new(turn.instance, now))
            if inst.state == _NEW:
                provisions += 1
                inst.state, inst.awake_since = _AWAKE, now
                inst.ready_at = now + (prof.pool_claim_s if pool.claim(now) else prov_s)
            elif inst.state == _ASLEEP:
                wakes += 1
                # A request that lands while the snapshot is still being written waits for it, then wakes.
                start = max(now, inst.asleep_since)
                storage += start - inst.asleep_since
                inst.state, inst.awake_since = _AWAKE, start
                inst.ready_at = start + prof.wake_s
            inst.gen += 1
            begin = max(now, inst.ready_at)
            latencies.append(begin - now)
            if inst.activity.turns == 0:
                provision_latencies.append(begin - now)
            inst.activity.turn_started(now)
            seq += 1
            heapq.heappush(heap, (begin + turn.service_s, seq, _END, inst, inst.gen))
        else:
            handle(heapq.heappop(heap))

    end = horizon
    for inst in insts.values():
        if inst.state == _AWAKE:
            stretch = max(end - inst.awake_since, 0.0)
            compute += stretch
            longest = max(longest, stretch)
        elif inst.state == _ASLEEP:
            storage += max(end - inst.asleep_since, 0.0)

    latencies.sort()
    provision_latencies.sort()
    pool_compute = settings.warm_pool * horizon
    delayed = len(latencies) - bisect.bisect_right(latencies, 0.0)
    total_latency = math.fsum(latencies)
    return PolicyResult(
        policy=policy.name,
        turns=n,
        instances=len(insts),
        horizon_s=horizon,
        compute_s=compute,
        pool_compute_s=pool_compute,
        awake_ram_gb_h=(compute + pool_compute) * prof.ram_gb / 3600.0,
        storage_gb_h=storage * prof.snapshot_gb / 3600.0,
        wakes=wakes,
        sleeps=sleeps,
        provisions=provisions,
        delayed_turns=delayed,
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        latency_max_s=latencies[-1] if latencies else 0.0,
        latency_mean_s=total_latency / n if n else 0.0,
        provision_p50_s=percentile(provision_latencies, 50),
        provision_p99_s=percentile(provision_latencies, 99),
        longest_awake_s=longest,
        cost_compute=(compute + pool_compute) * model.awake_per_s,
        cost_storage=storage * model.asleep_per_s,
        cost_latency=total_latency * model.prices.latency_per_s,
        currency=model.prices.currency,
    )


class Hindsight:
    """Not deployable: knows each instance's next arrival and sleeps iff the coming gap is past break-even.

    Replayed next to the real policies as the floor no online policy can beat by much (it ignores that a
    request may land during a snapshot, so it is a near-optimal reference, not a proof).
    """

    def __init__(self, trace: Trace, model: CostModel) -> None:
        self._arrivals: dict[str, list[float]] = {}
        for t in trace.turns:
            self._arrivals.setdefault(t.instance, []).append(t.arrival_s)
        self._horizon = trace.horizon_s
        self._econ = model.economics()
        self._sleep_cost = model.awake_per_s * model.instance.sleep_s

    @property
    def name(self) -> str:
        return "hindsight"

    def decide(self, activity: InstanceActivity, now: float) -> Decision:
        if activity.busy:
            return Decision(False, None, f"hindsight: {activity.in_flight} turn(s) in flight")
        e = self._econ
        arrivals = self._arrivals.get(activity.instance_id, [])
        j = bisect.bisect_right(arrivals, now)
        if j < len(arrivals):
            gap = arrivals[j] - now
            sleep_cost = e.asleep_per_s * gap + e.transition
        else:
            gap = max(self._horizon - now, 0.0)
            sleep_cost = e.asleep_per_s * gap + self._sleep_cost
        if sleep_cost < e.awake_per_s * gap:
            return Decision(True, None, f"hindsight: next request in {gap:.1f}s, sleeping is cheaper")
        return Decision(False, None, f"hindsight: next request in {gap:.1f}s, staying awake is cheaper")
