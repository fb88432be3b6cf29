"""Sleep policies: when an idle agent's micro-VM should be snapshotted to storage.

Owns the one ``SleepPolicy`` interface, its implementations, what they observe per instance, and the warm-pool model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from moorage.errors import InvalidInput

# Policies are pure: they never read a clock and never do I/O. The caller passes ``now`` (seconds on any
# monotonic scale: the live scheduler's wall clock or the simulator's virtual clock) and owns the
# ``InstanceActivity`` records, so the same code runs in production and in the cost simulator.


@dataclass(frozen=True)
class Decision:
    """What a policy wants done with one instance right now, and why."""

    sleep_now: bool
    #: When to ask again if nothing happens in between (same clock as ``now``); ``None``: only after the next turn.
    recheck_at: float | None
    #: One human-readable sentence: which rule fired with which numbers. Shown in logs and ``moorage`` output.
    reason: str


# ---------------------------------------------------------------------------------------------------------------
# What a policy observes about one instance
# ---------------------------------------------------------------------------------------------------------------

#: Idle gaps are binned on a log scale, two bins per doubling, from 0.25 s up to about a month: a few dozen
#: floats per instance, enough to tell "a turn every few seconds" from "a turn every few hours".
_GAP_BASE_S = 0.25
_BINS_PER_DOUBLING = 2
_N_BINS = 48
#: Weights grow by 1/(1-decay) per observation instead of shrinking all old ones; renormalise before overflow.
_RESCALE_AT = 1e200
#: A recheck scheduled at ``idle_since + T`` may see an idle time a rounding error short of ``T``.
_TIME_EPS_S = 1e-6


def _bin_of(gap_s: float) -> int:
    if gap_s <= _GAP_BASE_S:
        return 0
    i = int(math.floor(_BINS_PER_DOUBLING * math.log2(gap_s / _GAP_BASE_S)))
    return min(max(i, 0), _N_BINS - 1)


def _bin_upper_edge(i: int) -> float:
    return _GAP_BASE_S * 2.0 ** ((i + 1) / _BINS_PER_DOUBLING)


@dataclass
class IdleGapHistogram:
    """An exponentially decayed histogram of one instance's idle gaps (turn end → next request).

    Recent gaps weigh more (``decay`` per new gap), so a user whose habits change is re-learned within
    roughly ``1/decay`` gaps. Each bin keeps its weight and the weighted sum of its gaps, so the mean gap
    inside a bin is exact rather than a bin-edge guess.
    """

    decay: float = 0.05
    _weight: dict[int, float] = field(default_factory=dict)
    _sum: dict[int, float] = field(default_factory=dict)
    _scale: float = 1.0
    _count: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise InvalidInput(f"idle-gap decay must be in [0, 1), got {self.decay}", hint="use e.g. 0.05 (≈ last 20 gaps)")

    def observe(self, gap_s: float) -> None:
        if gap_s < 0 or math.isnan(gap_s):
            raise InvalidInput(f"an idle gap cannot be negative ({gap_s} s)", hint="pass times from one monotonic clock")
        if self._count:
            self._scale /= 1.0 - self.decay
        if self._scale > _RESCALE_AT:
            for k in self._weight:
                self._weight[k] /= self._scale
                self._sum[k] /= self._scale
            self._scale = 1.0
        b = _bin_of(gap_s)
        self._weight[b] = self._weight.get(b, 0.0) + self._scale
        self._sum[b] = self._sum.get(b, 0.0) + self._scale * gap_s
        self._count += 1

    @property
    def count(self) -> int:
        """How many gaps were ever observed (not decayed)."""
        return self._count

    def bins(self) -> list[tuple[float, float, float]]:
        """Non-empty bins in increasing gap order as ``(relative weight, mean gap s, upper edge s)``."""
        total = sum(self._weight.values())
        return [(self._weight[k] / total, self._sum[k] / self._weight[k], _bin_upper_edge(k)) for k in sorted(self._weight)]

    def longest_seen_s(self) -> float:
        """Mean gap of the longest non-empty bin (0 when nothing was observed)."""
        if not self._weight:
            return 0.0
        k = max(self._weight)
        return self._sum[k] / self._weight[k]

    def to_dict(self) -> dict[str, Any]:
        total = sum(self._weight.values()) or 1.0
        return {
            "decay": self.decay,
            "count": self._count,
            "bins": {str(k): [self._weight[k] / total, self._sum[k] / total] for k in sorted(self._weight)},
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "IdleGapHistogram":
        h = cls(decay=float(doc.get("decay", 0.05)))
        h._count = int(doc.get("count", 0))
        for k, (w, s) in doc.get("bins", {}).items():
            h._weight[int(k)] = float(w)
            h._sum[int(k)] = float(s)
        return h


@dataclass
class InstanceActivity:
    """The turn history one policy decision needs about one instance.

    The caller (lifecycle machine or simulator) reports ``turn_started``/``turn_ended`` as requests are
    accepted and answered, and may persist ``to_dict()`` so learned habits survive a host restart.
    """

    instance_id: str
    #: When the instance last became idle (end of its last turn, or its creation).
    idle_since: float
    in_flight: int = 0
    turns: int = 0
    #: Last turn start or end: the recency the host-capacity LRU ranks by.
    last_active: float = 0.0
    gaps: IdleGapHistogram = field(default_factory=IdleGapHistogram)

    @classmethod
    def new(cls, instance_id: str, now: float, *, decay: float = 0.05) -> "InstanceActivity":
        return cls(instance_id=instance_id, idle_since=now, last_active=now, gaps=IdleGapHistogram(decay=decay))

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    def idle_for(self, now: float) -> float:
        """Seconds idle at ``now`` (0 while a turn is in flight)."""
        if self.busy:
            return 0.0
        if now < self.idle_since:
            raise InvalidInput(
                f"instance {self.instance_id}: time went backwards ({now} < idle since {self.idle_since})",
                hint="pass times from one monotonic clock",
            )
        return now - self.idle_since

    def turn_started(self, now: float) -> None:
        """A request for this instance was accepted (before any wake it needs)."""
        if not self.busy:
            gap = self.idle_for(now)
            # The wait between creation and the first turn says nothing about the user's rhythm.
            if self.turns > 0:
                self.gaps.observe(gap)
        self.in_flight += 1
        self.turns += 1
        self.last_active = now

    def turn_ended(self, now: float) -> None:
        if not self.busy:
            raise InvalidInput(
                f"instance {self.instance_id}: turn ended but none was in flight",
                hint="call turn_started when a request is accepted, turn_ended once when it is answered",
            )
        self.in_flight -= 1
        self.last_active = now
        if not self.busy:
            self.idle_since = now

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "idle_since": self.idle_since,
            "in_flight": self.in_flight,
            "turns": self.turns,
            "last_active": self.last_active,
            "gaps": self.gaps.to_dict(),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "InstanceActivity":
        return cls(
            instance_id=str(doc["instance_id"]),
            idle_since=float(doc["idle_since"]),
            in_flight=int(doc.get("in_flight", 0)),
            turns=int(doc.get("turns", 0)),
            last_active=float(doc.get("last_active", doc["idle_since"])),
            gaps=IdleGapHistogram.from_dict(doc.get("gaps", {})),
        )


# ---------------------------------------------------------------------------------------------------------------
# The interface and its implementations
# ---------------------------------------------------------------------------------------------------------------


@runtime_checkable
class SleepPolicy(Protocol):
    """Decides, for one idle instance at a time, whether to snapshot it now or when to ask again.

    Contract (checked by tests/lifecycle/test_policies_conformance.py for every implementation):
    never ``sleep_now`` while a turn is in flight; same inputs give the same decision; ``recheck_at`` is
    ``None`` or later than ``now``; ``reason`` names the rule that fired.
    """

    @property
    def name(self) -> str: ...

    def decide(self, activity: InstanceActivity, now: float) -> Decision: ...


def _busy_decision(name: str, activity: InstanceActivity) -> Decision:
    return Decision(False, None, f"{name}: {activity.in_flight} turn(s) in flight; decide again when they end")


@dataclass(frozen=True)
class AlwaysOn:
    """Never sleeps: the baseline whose latency every other policy is compared with."""

    @property
    def name(self) -> str:
        return "always-on"

    def decide(self, activity: InstanceActivity, now: float) -> Decision:
        if activity.busy:
            return _busy_decision(self.name, activity)
        return Decision(False, None, "always-on: this policy never sleeps an instance")


def _fmt_s(seconds: float) -> str:
    if seconds == int(seconds) and seconds % 3600 == 0 and seconds > 0:
        return f"{int(seconds) // 3600}h"
    if seconds == int(seconds) and seconds % 60 == 0 and seconds > 0:
        return f"{int(seconds) // 60}min"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class FixedTimeout:
    """Sleeps once an instance has been idle for ``timeout_s``: the common default, and its failure modes."""

    timeout_s: float

    def __post_init__(self) -> None:
        if not self.timeout_s >= 0:
            raise InvalidInput(f"idle timeout must be ≥ 0 s, got {self.timeout_s}")

    @property
    def name(self) -> str:
        return f"fixed-{_fmt_s(self.timeout_s)}"

    def decide(self, activity: InstanceActivity, now: float) -> Decision:
        if activity.busy:
            return _busy_decision(self.name, activity)
        idle = activity.idle_for(now)
        # Compared as times, not durations: at ``recheck_at`` exactly this must hold despite rounding.
        if now >= activity.idle_since + self.timeout_s:
            return Decision(True, None, f"{self.name}: idle {idle:.1f}s ≥ timeout {self.timeout_s:g}s")
        return Decision(
            False, activity.idle_since + self.timeout_s, f"{self.name}: idle {idle:.1f}s < timeout {self.timeout_s:g}s"
        )


@dataclass(frozen=True)
class SleepEconomics:
    """What being awake, being asleep and one sleep→wake round trip cost, in one currency.

    Built from a price table by ``moorage.cost.CostModel.economics()``; kept here so that policies do not
    depend on how prices are configured.
    """

    #: Price of one instance being awake for one second (its vCPU share and RAM).
    awake_per_s: float
    #: Price of one instance's snapshot being stored for one second.
    asleep_per_s: float
    #: Price of one sleep followed by one wake: compute spent snapshotting and restoring, plus what the
    #: user's wait for the wake is worth.
    transition: float

    def __post_init__(self) -> None:
        if min(self.awake_per_s, self.asleep_per_s, self.transition) < 0:
            raise InvalidInput(f"prices cannot be negative: {self}", hint="check the [prices] table")

    @property
    def break_even_s(self) -> float:
        """Idle gap above which sleeping (and waking for the next turn) is cheaper than staying awake."""
        saving = self.awake_per_s - self.asleep_per_s
        return math.inf if saving <= 0 else self.transition / saving


@dataclass(frozen=True)
class Adaptive:
    """Learns each instance's idle gaps and sleeps at the idle time that minimises expected cost.

    With ``F`` the instance's decayed distribution of idle gaps, at idle time ``a`` it compares "sleep at
    ``T``" for ``T`` = now and every bin edge beyond ``a``: gaps ending before ``T`` cost awake time,
    longer ones cost awake time up to ``T``, storage after it, and one transition. The cheapest ``T`` is
    the plan; at ``T`` the same rule (now conditioned on a longer gap) confirms it. Until
    ``min_observations`` gaps are known, and once the gap outlasts everything seen, it falls back to the
    ski-rental rule — stay awake for one break-even time, then sleep — which never costs more than twice
    the hindsight optimum.
    """

    economics: SleepEconomics
    min_observations: int = 3

    @property
    def name(self) -> str:
        return "adaptive"

    def decide(self, activity: InstanceActivity, now: float) -> Decision:
        if activity.busy:
            return _busy_decision(self.name, activity)
        idle = activity.idle_for(now)
        econ = self.economics
        be = econ.break_even_s
        if math.isinf(be):
            return Decision(False, None, "adaptive: storing a snapshot costs as much as running; never sleeps")
        h = activity.gaps
        if h.count < self.min_observations:
            return self._ski_rental(activity, idle, 0.0, f"only {h.count} idle gap(s) seen")
        tail = [(w, m, edge) for (w, m, edge) in h.bins() if m > idle]
        if not tail:
            longest = h.longest_seen_s()
            return self._ski_rental(activity, idle, longest, f"idle {idle:.1f}s outlasts every gap seen (≤{longest:.1f}s)")
        best_t, best_cost, sleep_now_cost, p_long = self._plan(idle, tail)
        if best_t <= idle + _TIME_EPS_S:
            return Decision(
                True,
                None,
                f"adaptive: sleeping now costs {sleep_now_cost / econ.awake_per_s:.1f} awake-s expected, least of all "
                f"sleep times (break-even {be:.1f}s, {h.count} gaps learned)",
            )
        return Decision(
            False,
            activity.idle_since + best_t,
            f"adaptive: {p_long:.0%} of remaining gaps outlast {best_t:.1f}s; sleeping at {best_t:.1f}s idle costs "
            f"{best_cost / econ.awake_per_s:.1f} awake-s expected vs {sleep_now_cost / econ.awake_per_s:.1f} for sleeping "
            f"now (break-even {be:.1f}s)",
        )

    def _ski_rental(self, activity: InstanceActivity, idle: float, start: float, why: str) -> Decision:
        be = self.economics.break_even_s
        deadline = start + be
        if idle + _TIME_EPS_S >= deadline:
            return Decision(True, None, f"adaptive: {why}; idle {idle:.1f}s ≥ {deadline:.1f}s (ski-rental: break-even {be:.1f}s)")
        return Decision(
            False,
            activity.idle_since + deadline,
            f"adaptive: {why}; stays awake until {deadline:.1f}s idle (ski-rental: break-even {be:.1f}s)",
        )

    def _plan(self, idle: float, tail: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
        """Cheapest sleep time for the remaining gap, as (idle time T, expected cost, cost of T=idle, P(gap > T)).

        Costs are expected prices of the rest of this gap, conditioned on it being longer than ``idle``.
        """
        e = self.economics
        total = sum(w for w, _, _ in tail)
        # Sleeping now: every remaining gap is spent asleep and ends in a wake.
        suffix_w = total
        suffix_wm = sum(w * m for w, m, _ in tail)
        sleep_now = (e.asleep_per_s * (suffix_wm - suffix_w * idle) + e.transition * suffix_w) / total
        best_t, best_cost, best_p = idle, sleep_now, 1.0
        awake_part = 0.0
        for w, m, edge in tail:
            # Sleep at this bin's upper edge: gaps up to here are served awake, longer ones sleep at ``edge``.
            awake_part += w * (m - idle)
            suffix_w -= w
            suffix_wm -= w * m
            if suffix_w <= total * 1e-12:
                suffix_w, suffix_wm = 0.0, 0.0
            long_part = (
                e.awake_per_s * (edge - idle) * suffix_w
                + e.asleep_per_s * (suffix_wm - suffix_w * edge)
                + e.transition * suffix_w
            )
            cost = (e.awake_per_s * awake_part + long_part) / total
            # Strictly cheaper only: on a tie the earlier sleep wins, which keeps the choice deterministic.
            if cost < best_cost * (1 - 1e-9):
                best_t, best_cost, best_p = edge, cost, suffix_w / total
        return best_t, best_cost, sleep_now, best_p


def parse_policy(spec: str, economics: SleepEconomics | None = None) -> SleepPolicy:
    """Build a policy from a short spec: ``always-on``, ``adaptive``, ``fixed:300`` / ``fixed-5min`` / ``fixed-30s``."""
    s = spec.strip().lower()
    if s == "always-on":
        return AlwaysOn()
    if s == "adaptive":
        if economics is None:
            raise InvalidInput("the adaptive policy needs prices", hint="pass SleepEconomics (e.g. CostModel().economics())")
        return Adaptive(economics)
    if s.startswith("fixed"):
        raw = s[len("fixed"):]
        # One separator only: "fixed:-3" is a negative timeout, not 3 s.
        raw = raw[1:] if raw[:1] in (":", "-", "=") else raw
        return FixedTimeout(_parse_duration(raw, spec))
    raise InvalidInput(f"unknown sleep policy {spec!r}", hint="use always-on, adaptive, or fixed:<seconds> (e.g. fixed:300, fixed-5min)")


def _parse_duration(raw: str, spec: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            number, mult = raw[: -len(suffix)], units[suffix]
            break
    else:
        number, mult = raw, 1.0
    try:
        value = float(number) * mult
    except ValueError:
        raise InvalidInput(f"cannot read a timeout from {spec!r}", hint="write e.g. fixed:300, fixed-30s or fixed-5min") from None
    if value < 0 or math.isnan(value):
        raise InvalidInput(f"idle timeout in {spec!r} must be ≥ 0")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Warm pool: provisioning, not sleeping
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class WarmPool:
    """Pre-forked sandboxes kept ready so a brand-new agent skips the fork from the template snapshot.

    A pure model on the caller's clock: ``claim(now)`` says whether a ready sandbox was taken (else the
    caller forks on demand) and starts refilling that slot, which is ready again ``refill_s`` later.
    ``size=0`` is plain fork-on-demand.
    """

    size: int
    refill_s: float
    _ready_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 0 or self.refill_s < 0:
            raise InvalidInput(f"warm pool size and refill time must be ≥ 0 (size={self.size}, refill={self.refill_s})")
        if not self._ready_at:
            self._ready_at = [0.0] * self.size

    def ready(self, now: float) -> int:
        return sum(1 for t in self._ready_at if t <= now)

    def claim(self, now: float) -> bool:
        """Take a ready pre-forked sandbox if there is one; its slot is re-forked in the background."""
        for i, t in enumerate(self._ready_at):
            if t <= now:
                self._ready_at[i] = now + self.refill_s
                return True
        return False
