"""Conformance suite: every SleepPolicy implementation must pass every test here."""

from __future__ import annotations

import copy
import random
from typing import Callable

import pytest

from moorage.cost import CostModel, Hindsight, Trace, Turn
from moorage.lifecycle.policies import (
    Adaptive,
    AlwaysOn,
    FixedTimeout,
    InstanceActivity,
    SleepPolicy,
)

ECON = CostModel().economics()


def _history(gaps: list[float], service: float = 2.0) -> list[tuple[str, float]]:
    """Turn start/end events for one instance: turn, gap, turn, gap, ..."""
    events, t = [], 0.0
    for g in [0.0, *gaps]:
        t += g
        events.append(("start", t))
        t += service
        events.append(("end", t))
    return events


def _replay(events: list[tuple[str, float]]) -> InstanceActivity:
    act = InstanceActivity.new("i-1", 0.0)
    for kind, t in events:
        act.turn_started(t) if kind == "start" else act.turn_ended(t)
    return act


CHATTY = _history([4.0, 6.0, 5.0, 3.0, 7.0] * 6)
SPARSE = _history([3600.0, 5400.0, 7200.0] * 4)
BIMODAL = _history([10.0, 12.0, 9.0, 7200.0] * 6)
HISTORIES = {"fresh": [], "chatty": CHATTY, "sparse": SPARSE, "bimodal": BIMODAL}

_TRACE = Trace.of([Turn("i-1", t, 2.0) for t in (0.0, 30.0, 4000.0)], 9000.0)

POLICIES: dict[str, Callable[[], SleepPolicy]] = {
    "always-on": AlwaysOn,
    "fixed-0s": lambda: FixedTimeout(0.0),
    "fixed-30s": lambda: FixedTimeout(30.0),
    "fixed-5min": lambda: FixedTimeout(300.0),
    "adaptive": lambda: Adaptive(ECON),
    "adaptive-eager": lambda: Adaptive(ECON, min_observations=1),
    "hindsight": lambda: Hindsight(_TRACE, CostModel()),
}


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> SleepPolicy:
    return POLICIES[request.param]()


def test_implements_the_protocol(policy: SleepPolicy) -> None:
    assert isinstance(policy, SleepPolicy)
    assert policy.name


@pytest.mark.parametrize("history", sorted(HISTORIES))
def test_never_sleeps_an_instance_mid_turn(policy: SleepPolicy, history: str) -> None:
    act = _replay(HISTORIES[history])
    start = act.idle_since + 1.0
    act.turn_started(start)
    # However long the turn runs, and with a second turn overlapping it, the answer is "not now".
    for now in (start, start + 0.5, start + 60.0, start + 86400.0):
        d = policy.decide(act, now)
        assert not d.sleep_now, d.reason
    act.turn_started(start + 10.0)
    act.turn_ended(start + 20.0)
    assert act.busy
    for now in (start + 20.0, start + 10_000.0):
        assert not policy.decide(act, now).sleep_now


@pytest.mark.parametrize("history", sorted(HISTORIES))
def test_same_inputs_same_decision_and_no_hidden_state(policy: SleepPolicy, history: str) -> None:
    a, b = _replay(HISTORIES[history]), _replay(HISTORIES[history])
    before = copy.deepcopy(a.to_dict())
    times = [a.idle_since + x for x in (0.0, 0.1, 3.0, 9.0, 31.0, 120.0, 3600.0, 86400.0)]
    first = [policy.decide(a, t) for t in times]
    # Asking in a different order, of another policy object, and of an equal copy changes nothing.
    again = [policy.decide(a, t) for t in reversed(times)][::-1]
    other = [POLICIES[next(k for k, f in POLICIES.items() if f().name == policy.name)]().decide(b, t) for t in times]
    assert first == again == other
    assert a.to_dict() == before, "decide() must not change the activity it reads"


@pytest.mark.parametrize("history", sorted(HISTORIES))
def test_recheck_is_in_the_future_and_reason_is_explained(policy: SleepPolicy, history: str) -> None:
    act = _replay(HISTORIES[history])
    for x in (0.0, 1.0, 30.0, 600.0, 7200.0):
        now = act.idle_since + x
        d = policy.decide(act, now)
        assert d.recheck_at is None or d.recheck_at > now
        assert d.reason.startswith(policy.name.split("-")[0]), d.reason
        assert len(d.reason) > len(policy.name) + 5
        if d.sleep_now:
            assert d.recheck_at is None


@pytest.mark.parametrize("history", sorted(HISTORIES))
def test_following_rechecks_terminates(policy: SleepPolicy, history: str) -> None:
    """Asking again at recheck_at either sleeps, stops asking, or asks strictly later: no livelock."""
    act = _replay(HISTORIES[history])
    now = act.idle_since
    for _ in range(200):
        d = policy.decide(act, now)
        if d.sleep_now or d.recheck_at is None:
            return
        assert d.recheck_at > now
        now = d.recheck_at
    pytest.fail(f"{policy.name} kept asking to recheck 200 times without deciding")


def test_random_event_sequences_never_sleep_busy(policy: SleepPolicy) -> None:
    rng = random.Random(7)
    act = InstanceActivity.new("i-1", 0.0)
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(1 / 20.0)
        if act.busy and rng.random() < 0.6:
            act.turn_ended(now)
        else:
            act.turn_started(now)
        d = policy.decide(act, now)
        if act.busy:
            assert not d.sleep_now
