"""Synthetic arrival traces: named scenarios of how end-users talk to their agents, reproducible from a seed.

Each scenario is a small generative model (Poisson sessions, log-normal think times); docs/cost.md describes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moorage.cost.trace import Trace, Turn
from moorage.errors import InvalidInput

_Rng = np.random.Generator
#: Arrival times for one user, seconds since trace start (unsorted is fine).
_UserModel = Callable[[_Rng, float], np.ndarray]


def _service(rng: _Rng, n: int, median_s: float = 4.0) -> np.ndarray:
    # LLM turns: a few seconds typically, a long tail of tool-heavy turns.
    return np.clip(rng.lognormal(math.log(median_s), 0.6, n), 0.2, 120.0)


def _poisson_times(rng: _Rng, rate_per_s: float, horizon_s: float) -> np.ndarray:
    n = rng.poisson(rate_per_s * horizon_s)
    return rng.uniform(0.0, horizon_s, n)


def _sessions(rng: _Rng, starts: np.ndarray, mean_turns: float, gap_median_s: float, gap_sigma: float) -> np.ndarray:
    """Expand session start times into turn arrivals: 1 + geometric turns, log-normal gaps between them."""
    out = []
    for s in starts:
        n = int(rng.geometric(1.0 / mean_turns)) if mean_turns > 1 else 1
        gaps = rng.lognormal(math.log(gap_median_s), gap_sigma, n - 1)
        out.append(s + np.concatenate(([0.0], np.cumsum(gaps))))
    return np.concatenate(out) if out else np.empty(0)


def _steady(rng: _Rng, horizon_s: float) -> np.ndarray:
    # A turn every few minutes around the clock; users differ in pace (median gap 4 min).
    mean_gap = rng.lognormal(math.log(240.0), 0.5)
    return _poisson_times(rng, 1.0 / mean_gap, horizon_s)


def _bursty(rng: _Rng, horizon_s: float) -> np.ndarray:
    # Conversations (~8 turns, ~20 s apart) separated by about 90 minutes of silence.
    mean_between = rng.lognormal(math.log(90 * 60.0), 0.4)
    starts = _poisson_times(rng, 1.0 / mean_between, horizon_s)
    return _sessions(rng, starts, 8.0, 20.0, 0.8)


def _diurnal_rate(local_hour: np.ndarray) -> np.ndarray:
    # Relative activity over the day: quiet at night, peak mid-afternoon.
    return 0.05 + 0.95 * np.exp(-(((local_hour - 14.0) / 4.0) ** 2))


def _diurnal(rng: _Rng, horizon_s: float) -> np.ndarray:
    # Bursty conversations whose rate follows the user's local day (time zones spread ±3 h).
    offset_h = rng.normal(0.0, 3.0)
    peak_rate = 1.0 / rng.lognormal(math.log(45 * 60.0), 0.4)
    candidates = _poisson_times(rng, peak_rate, horizon_s)
    local = ((candidates / 3600.0) + offset_h) % 24.0
    starts = candidates[rng.uniform(0.0, 1.0, len(candidates)) < _diurnal_rate(local)]
    return _sessions(rng, starts, 8.0, 20.0, 0.8)


def _many_idle(rng: _Rng, horizon_s: float) -> np.ndarray:
    # Most users open their agent at most once or twice a day, for a handful of turns.
    starts = _poisson_times(rng, 0.6 / 86400.0, horizon_s)
    return _sessions(rng, starts, 3.0, 30.0, 0.8)


def _chatty(rng: _Rng, horizon_s: float) -> np.ndarray:
    # A turn every few seconds (median 5 s) for the whole trace: an agent driven by a busy user or a script.
    n = int(horizon_s / 3.0) + 16
    t = np.cumsum(rng.lognormal(math.log(5.0), 0.4, n))
    return t[t < horizon_s]


def _periodic(rng: _Rng, horizon_s: float) -> np.ndarray:
    # Long working stretches with a turn every 1-4 minutes: gaps too short for a 5-minute timeout to ever fire.
    start = rng.uniform(0.0, max(horizon_s - 12 * 3600.0, 1.0))
    length = min(horizon_s - start, rng.uniform(6, 12) * 3600.0)
    pace = rng.uniform(60.0, 240.0)
    n = int(length / pace) + 1
    return start + np.cumsum(rng.uniform(0.7 * pace, 1.3 * pace, n))[: max(n - 1, 1)]


def _mixed(rng: _Rng, horizon_s: float) -> np.ndarray:
    # One population, three habits: no single idle timeout suits them all.
    kind = rng.uniform()
    if kind < 0.1:
        # Chatty sessions of 1-2 hours, twice a day.
        out = []
        for s in rng.uniform(0.0, max(horizon_s - 7200.0, 1.0), 2):
            span = rng.uniform(3600.0, 7200.0)
            t = s + np.cumsum(rng.lognormal(math.log(5.0), 0.4, int(span / 3.0)))
            out.append(t[t < s + span])
        return np.concatenate(out)
    if kind < 0.4:
        return _periodic(rng, horizon_s)
    return _bursty(rng, horizon_s)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    default_users: int
    default_hours: float
    model: _UserModel
    service_median_s: float = 4.0


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("steady", "Poisson turns around the clock, median gap 4 min per user", 100, 24.0, _steady),
        Scenario("bursty", "conversations of ~8 turns ~20 s apart, ~90 min of silence between", 100, 24.0, _bursty),
        Scenario("diurnal", "bursty conversations following each user's local day", 200, 24.0, _diurnal),
        Scenario("many-idle", "many users who open their agent at most once or twice a day", 2000, 24.0, _many_idle),
        Scenario("chatty", "one user with a turn every few seconds for hours", 1, 8.0, _chatty, 2.0),
        Scenario("periodic", "working stretches with a turn every 1-4 min (a 5 min timeout never fires)", 50, 24.0, _periodic),
        Scenario("mixed", "10% chatty, 30% periodic, 60% bursty users on one host", 100, 24.0, _mixed),
    ]
}


def generate(scenario: str, *, users: int | None = None, hours: float | None = None, seed: int = 0) -> Trace:
    """A trace for ``scenario``; the same arguments always give the same trace."""
    sc = SCENARIOS.get(scenario)
    if sc is None:
        raise InvalidInput(f"unknown scenario {scenario!r}", hint=f"choose one of: {', '.join(SCENARIOS)}")
    n_users = sc.default_users if users is None else users
    n_hours = sc.default_hours if hours is None else hours
    if n_users < 1 or not n_hours > 0:
        raise InvalidInput(f"need at least 1 user and a positive duration (users={n_users}, hours={n_hours})")
    horizon = n_hours * 3600.0
    width = max(4, len(str(n_users - 1)))
    turns: list[Turn] = []
    for u in range(n_users):
        # One child stream per user: adding users does not change the earlier users' traffic.
        rng = np.random.default_rng([seed, u])
        arrivals = np.sort(sc.model(rng, horizon))
        arrivals = arrivals[(arrivals >= 0.0) & (arrivals < horizon)]
        services = _service(rng, len(arrivals), sc.service_median_s)
        name = f"u{u:0{width}d}"
        # Millisecond resolution, so a trace written to JSONL and read back is identical.
        turns.extend(Turn(name, round(float(a), 3), round(float(s), 3)) for a, s in zip(arrivals, services))
    meta = {"scenario": scenario, "users": n_users, "hours": n_hours, "seed": seed}
    return Trace.of(turns, horizon, meta)
