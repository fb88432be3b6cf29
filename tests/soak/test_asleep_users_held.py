"""A host that runs for weeks serves far more users than it keeps awake: what it holds in memory per instance must
go once the instance has slept a while, not stay for every user it ever served (found by the soak run,
bench/soak: ~13 KiB per user asleep, until a restart or a forget). Released, the instance still wakes as before,
and the idle gap that ends with its next turn is still learned."""

from __future__ import annotations

import asyncio

import pytest

from moorage.store import Scope
from tests.lifecycle.test_manager_env import LcEnv, lc_env  # noqa: F401  (fixture)

HOUR = 3600.0


def held(m) -> dict[str, int]:  # noqa: ANN001 - an InstanceManager
    return {"instances": len(m._live), "by record": len(m._by_record), "sandbox handles": len(m.driver._open)}


@pytest.mark.parametrize("lc_env", ["process-sqlite"], indirect=True)
async def test_instances_asleep_for_a_while_are_not_held_in_memory(lc_env: LcEnv) -> None:  # noqa: F811
    env = lc_env
    m = env.manager(ttl_every_s=0.1)
    m.release_after_s = 0.5
    await m.start()
    users = [Scope.for_user("helper", f"u{i}") for i in range(5)]
    for scope in users:
        async with m.turn(env.ts, scope, env.template):
            pass
        assert await m.sleep(env.ts, scope)
    for _ in range(60):
        if held(m) == {"instances": 0, "by record": 0, "sandbox handles": 0}:
            break
        await asyncio.sleep(0.1)
    assert held(m) == {"instances": 0, "by record": 0, "sandbox handles": 0}, \
        f"5 users asleep for a while are still held: {held(m)}"

    # Released, the instance wakes from its snapshot as before, its history read back from its record.
    async with m.turn(env.ts, users[0], env.template) as sb:
        assert sb.state.value == "running"
    li = m.live(env.ts, users[0])
    assert li is not None and li.activity.turns == 2
    assert env.ts.sandboxes.for_scope(users[0]).state == "running"


@pytest.mark.parametrize("lc_env", ["process-sqlite"], indirect=True)
async def test_the_gap_that_ends_after_a_release_is_still_learned(lc_env: LcEnv) -> None:  # noqa: F811
    env = lc_env
    now = [1_000_000.0]
    m = env.manager(clock=lambda: now[0])
    alice = Scope.for_user("helper", "alice")
    for _ in range(2):  # one hour-long gap between two turns
        async with m.turn(env.ts, alice, env.template):
            pass
        now[0] += HOUR
    assert await m.sleep(env.ts, alice)
    assert m.release_asleep() == 1 and m.live(env.ts, alice) is None
    async with m.turn(env.ts, alice, env.template):  # two hours after the last turn ended
        pass
    li = m.live(env.ts, alice)
    assert li is not None and li.activity.gaps.count == 2 and li.activity.turns == 3
