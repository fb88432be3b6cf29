"""Behaviour of each sleep policy beyond the shared contract: what fixed timeouts do, what adaptive learns."""

from __future__ import annotations

import pytest

from moorage.cost import CostModel
from moorage.errors import InvalidInput
from moorage.lifecycle.policies import (
    Adaptive,
    AlwaysOn,
    FixedTimeout,
    IdleGapHistogram,
    InstanceActivity,
    SleepEconomics,
    WarmPool,
    parse_policy,
)

ECON = CostModel().economics()
BE = ECON.break_even_s


def _activity(gaps: list[float], service: float = 2.0) -> InstanceActivity:
    act = InstanceActivity.new("u1", 0.0)
    t = 0.0
    for g in [0.0, *gaps]:
        t += g
        act.turn_started(t)
        t += service
        act.turn_ended(t)
    return act


def test_default_break_even_is_tens_of_seconds() -> None:
    # 0.25 vCPU + 0.25 GB awake vs a 0.13 GB snapshot, 100 ms wake valued at 0.1 cent per second.
    assert 20 < BE < 60
    e = SleepEconomics(awake_per_s=1.0, asleep_per_s=0.5, transition=3.0)
    assert e.break_even_s == pytest.approx(6.0)
    assert SleepEconomics(1.0, 1.0, 3.0).break_even_s == float("inf")


def test_fixed_timeout_sleeps_exactly_at_the_timeout() -> None:
    p = FixedTimeout(30.0)
    act = _activity([10.0])
    d = p.decide(act, act.idle_since + 5.0)
    assert not d.sleep_now and d.recheck_at == act.idle_since + 30.0
    assert p.decide(act, d.recheck_at).sleep_now
    assert "timeout 30s" in p.decide(act, act.idle_since + 31).reason


def test_always_on_never_sleeps() -> None:
    act = _activity([3600.0] * 5)
    d = AlwaysOn().decide(act, act.idle_since + 10 * 86400)
    assert not d.sleep_now and d.recheck_at is None


def test_adaptive_without_history_uses_ski_rental() -> None:
    act = _activity([])
    d = Adaptive(ECON).decide(act, act.idle_since)
    assert not d.sleep_now
    assert d.recheck_at == pytest.approx(act.idle_since + BE)
    assert "ski-rental" in d.reason
    assert Adaptive(ECON).decide(act, d.recheck_at).sleep_now


def test_adaptive_stays_awake_for_a_chatty_user() -> None:
    act = _activity([4.0, 6.0, 5.0, 3.0, 7.0, 5.0] * 8)
    d = Adaptive(ECON).decide(act, act.idle_since)
    assert not d.sleep_now
    # It plans to stay up through every gap it has seen (≤ 7 s) ...
    assert d.recheck_at is not None and d.recheck_at - act.idle_since >= 7.0
    # ... and when the silence outlasts them all, it gives the user one break-even time more, then sleeps.
    t = d.recheck_at
    while True:
        d = Adaptive(ECON).decide(act, t)
        if d.sleep_now:
            break
        assert d.recheck_at is not None
        t = d.recheck_at
    assert 7.0 + BE - 1 <= t - act.idle_since <= 7.0 + BE + 8.0
    assert "outlasts every gap" in d.reason


def test_adaptive_sleeps_at_once_after_long_gaps() -> None:
    act = _activity([3600.0, 5400.0, 2700.0, 7200.0])
    d = Adaptive(ECON).decide(act, act.idle_since)
    assert d.sleep_now, d.reason
    assert "sleeping now" in d.reason


def test_adaptive_sleeps_once_the_short_mode_is_over() -> None:
    # Conversations: gaps ~10 s inside, 2 h between. Stay up ~10 s, then sleep rather than idling further.
    act = _activity([10.0, 11.0, 9.0, 7200.0] * 10)
    p = Adaptive(ECON)
    d = p.decide(act, act.idle_since)
    assert not d.sleep_now
    assert d.recheck_at is not None and 10.0 <= d.recheck_at - act.idle_since <= 20.0
    assert p.decide(act, d.recheck_at).sleep_now


def test_adaptive_relearns_when_habits_change() -> None:
    act = _activity([5.0] * 30 + [3600.0] * 60)
    assert Adaptive(ECON).decide(act, act.idle_since).sleep_now


def test_adaptive_never_sleeps_when_storage_costs_more_than_running() -> None:
    econ = SleepEconomics(awake_per_s=1e-6, asleep_per_s=2e-6, transition=0.0)
    act = _activity([3600.0] * 5)
    d = Adaptive(econ).decide(act, act.idle_since + 86400)
    assert not d.sleep_now and d.recheck_at is None


def test_learned_state_survives_persistence() -> None:
    act = _activity([10.0, 11.0, 9.0, 7200.0] * 10)
    back = InstanceActivity.from_dict(act.to_dict())
    p = Adaptive(ECON)
    for x in (0.0, 5.0, 15.0, 60.0, 4000.0):
        assert p.decide(back, act.idle_since + x) == p.decide(act, act.idle_since + x)


def test_histogram_decays_old_gaps() -> None:
    h = IdleGapHistogram(decay=0.1)
    for _ in range(50):
        h.observe(5.0)
    for _ in range(50):
        h.observe(3600.0)
    weights = {round(m): w for w, m, _ in h.bins()}
    assert weights[3600] > 0.99 and weights[5] < 0.01
    with pytest.raises(InvalidInput):
        h.observe(-1.0)
    with pytest.raises(InvalidInput):
        IdleGapHistogram(decay=1.0)


def test_first_wait_after_creation_is_not_learned() -> None:
    act = InstanceActivity.new("u1", 0.0)
    act.turn_started(500.0)
    act.turn_ended(502.0)
    assert act.gaps.count == 0
    act.turn_started(510.0)
    assert act.gaps.count == 1 and act.gaps.bins()[0][1] == pytest.approx(8.0)


def test_activity_rejects_misuse() -> None:
    act = InstanceActivity.new("u1", 10.0)
    with pytest.raises(InvalidInput, match="none was in flight"):
        act.turn_ended(11.0)
    with pytest.raises(InvalidInput, match="backwards"):
        act.idle_for(5.0)


@pytest.mark.parametrize(
    ("spec", "name"),
    [("always-on", "always-on"), ("adaptive", "adaptive"), ("fixed:300", "fixed-5min"), ("fixed-30s", "fixed-30s"),
     ("fixed-5min", "fixed-5min"), ("FIXED:1h", "fixed-1h"), ("fixed:0.5", "fixed-0.5s")],
)
def test_parse_policy(spec: str, name: str) -> None:
    assert parse_policy(spec, ECON).name == name


@pytest.mark.parametrize("spec", ["sometimes", "fixed:abc", "fixed:-3", "adaptive-ish"])
def test_parse_policy_rejects_unknown(spec: str) -> None:
    with pytest.raises(InvalidInput):
        parse_policy(spec, ECON)


def test_adaptive_spec_needs_prices() -> None:
    with pytest.raises(InvalidInput, match="prices"):
        parse_policy("adaptive")


def test_warm_pool_claims_ready_sandboxes_and_refills() -> None:
    pool = WarmPool(size=2, refill_s=0.5)
    assert pool.ready(0.0) == 2
    assert pool.claim(0.0) and pool.claim(0.0)
    assert not pool.claim(0.1)  # both slots are being re-forked: this agent forks on demand
    assert pool.ready(0.5) == 2
    assert WarmPool(size=0, refill_s=1.0).claim(0.0) is False
    with pytest.raises(InvalidInput):
        WarmPool(size=-1, refill_s=1.0)
