"""The adaptive sleep policy's learned idle gaps survive the host: written into the instance's record as it
sleeps, read back by the next manager, which then sleeps the user's instance at once (as the first did)."""

from __future__ import annotations

import pytest

from moorage.lifecycle.policies import Adaptive, SleepEconomics
from moorage.store import Scope
from tests.lifecycle.test_manager_env import PROCESS_ONLY, LcEnv, lc_env  # noqa: F401  (fixture)

ALICE = Scope.for_user("helper", "alice")
BOB = Scope.for_user("helper", "bob")
#: Break-even 100 s: an hour-long gap is far past it, so a user who always leaves for an hour is slept at once.
ECON = SleepEconomics(awake_per_s=1.0, asleep_per_s=0.0, transition=100.0)
HOUR = 3600.0


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_learned_gaps_survive_a_restart(lc_env: LcEnv) -> None:
    env = lc_env
    now = [1_000_000.0]

    def clock() -> float:
        return now[0]

    first = env.manager(policy=Adaptive(ECON), clock=clock)
    for _ in range(4):  # three hour-long gaps between four turns
        async with first.turn(env.ts, ALICE, env.template):
            pass
        now[0] += HOUR
    learned = first.live(env.ts, ALICE)
    assert learned is not None and learned.activity.gaps.count == 3
    now[0] -= HOUR - 1.0  # one second after the last turn
    assert first.live(env.ts, ALICE).policy.decide(learned.activity, clock()).sleep_now
    assert await first.sleep(env.ts, ALICE)
    await first.close()

    # A new manager (the host restarted) on the same store: the first turn reads the history back.
    second = env.manager(policy=Adaptive(ECON), clock=clock)
    now[0] += HOUR
    async with second.turn(env.ts, ALICE, env.template):
        pass
    now[0] += 1.0
    restored = second.live(env.ts, ALICE)
    assert restored is not None and restored.activity.gaps.count == 3 and restored.activity.turns == 5
    decision = restored.policy.decide(restored.activity, clock())
    assert decision.sleep_now, decision.reason
    assert await second.tick() == 1 and env.ts.sandboxes.for_scope(ALICE).state == "sleeping"

    # Without a history (a user never seen) the same policy only has its ski-rental fallback: it waits.
    async with second.turn(env.ts, BOB, env.template):
        pass
    now[0] += 1.0
    fresh = second.live(env.ts, BOB)
    assert not fresh.policy.decide(fresh.activity, clock()).sleep_now
