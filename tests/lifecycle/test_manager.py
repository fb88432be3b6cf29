"""The instance manager on real sandboxes and a real store: single-flight wake, idle sleep, capacity, TTL, placement."""

from __future__ import annotations

import asyncio
import time

import pytest

from moorage.lifecycle.capacity import CapacityExhausted, HostCapacity
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.policies import Adaptive, FixedTimeout, SleepEconomics
from moorage.lifecycle.ttl import sweep
from moorage.sandbox import SandboxState
from moorage.store import Scope
from moorage.usage import ledger
from tests.lifecycle.test_manager_env import PROCESS_ONLY, TEMPLATE_FILE, LcEnv, forward, lc_env  # noqa: F401  (fixture)

ALICE = Scope.for_user("helper", "alice")
BOB = Scope.for_user("helper", "bob")


async def _until(pred, what: str, limit_s: float = 60.0) -> None:
    """Wait for a state the background loops must reach (a bound on hanging, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not await pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


def _state(env: LcEnv, scope: Scope) -> str | None:
    rec = env.ts.sandboxes.for_scope(scope)
    return None if rec is None else rec.state


async def test_hundred_concurrent_requests_to_a_sleeping_agent_wake_it_exactly_once(lc_env: LcEnv) -> None:
    env = lc_env
    m = env.manager(policy=FixedTimeout(3600))
    sb = await m.ensure_running(env.ts, ALICE, env.template)
    assert await sb.read_file(TEMPLATE_FILE) == b"prepared in the template"  # forked from the template
    assert await m.sleep(env.ts, ALICE)
    assert _state(env, ALICE) == "sleeping"

    async def one(i: int) -> str:
        async with m.turn(env.ts, ALICE, env.template) as sandbox:
            return await forward(sandbox, {"op": "echo", "text": f"reply-{i}"})

    replies = await asyncio.gather(*[one(i) for i in range(100)])
    assert replies == [f"reply-{i}" for i in range(100)]
    assert len(env.spans("lifecycle.woke")) == 1 and len(env.spans("lifecycle.claim_wake")) == 1
    assert env.ts.usage.totals(agent_id="helper")["wakes"] == 1
    assert m.stats.wakes == 1 and m.stats.provisions == 1
    assert _state(env, ALICE) == "running"


async def test_idle_agent_sleeps_under_fixed_timeout_but_never_mid_turn(lc_env: LcEnv) -> None:
    env = lc_env
    m = env.manager(policy=FixedTimeout(0.3), tick_s=0.05)
    await m.start()
    async with m.turn(env.ts, ALICE, env.template) as sb:
        # The turn outlasts the timeout several times over: the idle loop must leave it alone.
        assert await forward(sb, {"op": "hold", "seconds": 1.5})
        assert sb.state is SandboxState.RUNNING and _state(env, ALICE) == "running"
    assert not env.spans("lifecycle.claim_sleep")

    async def asleep() -> bool:
        return _state(env, ALICE) == "sleeping"

    await _until(asleep, "idle agent slept")
    (slept,) = env.spans("lifecycle.slept")
    assert "fixed-0.3s" in slept.attrs["reason"] and "timeout" in slept.attrs["reason"]
    # And it wakes where it stopped.
    async with m.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.read_file(TEMPLATE_FILE) == b"prepared in the template"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_adaptive_policy_sleeps_at_break_even_before_it_has_learned(lc_env: LcEnv) -> None:
    env = lc_env
    econ = SleepEconomics(awake_per_s=1.0, asleep_per_s=0.0, transition=0.4)  # break-even 0.4 s
    m = env.manager(policy=Adaptive(econ), tick_s=0.05)
    await m.start()
    async with m.turn(env.ts, ALICE, env.template) as sb:
        await forward(sb, {"op": "echo", "text": "hi"})

    async def asleep() -> bool:
        return _state(env, ALICE) == "sleeping"

    await _until(asleep, "adaptive policy slept the idle agent")
    (slept,) = env.spans("lifecycle.slept")
    assert "ski-rental" in slept.attrs["reason"] and "break-even 0.4s" in slept.attrs["reason"]
    li = m.live(env.ts, ALICE)
    assert li is not None and li.activity.turns == 1 and not li.activity.busy


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_agent_config_chooses_its_sleep_policy(lc_env: LcEnv) -> None:
    env = lc_env
    m = env.manager(policy=FixedTimeout(3600), tick_s=0.05)
    await m.start()
    lc = AgentLifecycle(sleep="fixed:0.2")
    async with m.turn(env.ts, ALICE, env.template, lifecycle=lc):
        pass

    async def asleep() -> bool:
        return _state(env, ALICE) == "sleeping"

    await _until(asleep, "agent's own fixed:0.2 policy slept it")
    assert "fixed-0.2s" in env.spans("lifecycle.slept")[0].attrs["reason"]


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_capacity_evicts_least_recent_idle_instance_never_one_mid_turn(lc_env: LcEnv) -> None:
    env = lc_env
    m = env.manager(policy=FixedTimeout(3600), capacity=HostCapacity(max_awake=1))
    async with m.turn(env.ts, ALICE, env.template) as sb:
        await sb.write_file("note.txt", b"alice's")
    async with m.turn(env.ts, BOB, env.template):
        pass
    assert _state(env, ALICE) == "sleeping" and _state(env, BOB) == "running"
    assert m.stats.evictions == 1
    assert "host capacity" in env.spans("lifecycle.claim_sleep")[0].attrs["reason"]

    # Bob is mid-turn: Alice cannot get in, and Bob is not touched.
    hold = asyncio.Event()

    async def bob_turn() -> None:
        async with m.turn(env.ts, BOB, env.template):
            hold.set()
            await asyncio.sleep(1.0)

    task = asyncio.create_task(bob_turn())
    await hold.wait()
    with pytest.raises(CapacityExhausted) as e:
        await m.ensure_running(env.ts, ALICE, env.template)
    assert e.value.http_status == 503
    assert _state(env, BOB) == "running"
    await task
    # Alice's wake that failed for capacity leaves her record failed (not stuck in waking); the next request retries.
    assert _state(env, ALICE) == "failed"
    async with m.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.read_file("note.txt") == b"alice's"
    assert _state(env, BOB) == "sleeping"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_sleep_all_sleeps_every_idle_instance_it_owns_but_not_one_mid_turn(lc_env: LcEnv) -> None:
    """What a host whose sandboxes die with it (the process driver) does as it shuts down."""
    env = lc_env
    m = env.manager(policy=FixedTimeout(3600))
    for scope in (ALICE, BOB):
        async with m.turn(env.ts, scope, env.template) as sb:
            await sb.write_file("note.txt", scope.user.encode())
    carol = Scope.for_user("helper", "carol")
    hold, release = asyncio.Event(), asyncio.Event()

    async def carol_turn() -> None:
        async with m.turn(env.ts, carol, env.template):
            hold.set()
            await release.wait()

    task = asyncio.create_task(carol_turn())
    await hold.wait()
    assert await m.sleep_all("host shutting down") == (2, 1)
    assert _state(env, ALICE) == _state(env, BOB) == "sleeping" and _state(env, carol) == "running"
    assert {s.attrs["reason"] for s in env.spans("lifecycle.slept")} == {"host shutting down"}
    release.set()
    await task
    assert await m.sleep_all("host shutting down") == (1, 0)  # Carol, now idle; the sleeping ones are left alone
    async with m.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.read_file("note.txt") == b"alice"


async def test_ttl_archives_then_deletes_with_the_disk(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", archive_after_s=100, delete_after_s=200)
    m = env.manager(policy=FixedTimeout(3600))
    async with m.turn(env.ts, ALICE, env.template) as sb:
        await sb.write_file("secret.txt", b"to be forgotten")
    rec = env.ts.sandboxes.for_scope(ALICE)
    assert (env.root / rec.id).exists()
    report = await sweep(m, now=time.time() + 1000)
    assert report.archived == 0 and report.deleted == 0  # running instances are never archived or deleted
    assert await m.sleep(env.ts, ALICE)
    levels = ledger.storage(env.ts, since=0, agent="helper")
    assert levels["disk_bytes"] > 0, levels  # measured as it slept
    slept_at = env.ts.sandboxes.for_scope(ALICE).last_active
    assert (await sweep(m, now=slept_at + 50)).archived == 0
    assert (await sweep(m, now=slept_at + 150)).archived == 1
    assert _state(env, ALICE) == "archived"
    assert (env.root / rec.id).exists()
    assert (await sweep(m, now=slept_at + 250)).deleted == 1
    assert env.ts.sandboxes.for_scope(ALICE) is None
    assert not (env.root / rec.id).exists() and rec.id not in await m.driver.list()
    assert [s.attrs["to"] for s in env.spans("lifecycle.archive") + env.spans("lifecycle.delete")] == ["archived", "deleted"]
    # Usage no longer counts its bytes (it reported the last sleep's levels of a deleted instance for good).
    assert ledger.storage(env.ts, since=0, agent="helper") == dict.fromkeys(ledger.GAUGES, 0)
    assert ledger.storage(env.ts, since=0, agent="helper", user="alice") == dict.fromkeys(ledger.GAUGES, 0)
    # The user comes back: a fresh instance from the template, none of the deleted files.
    async with m.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.stat("secret.txt") is None
        assert await sb.read_file(TEMPLATE_FILE) == b"prepared in the template"
    assert env.ts.sandboxes.for_scope(ALICE).id != rec.id


async def test_archived_instance_wakes_on_request_with_its_files(lc_env: LcEnv) -> None:
    env = lc_env
    env.agent("helper", archive_after_s=1)
    m = env.manager(policy=FixedTimeout(3600))
    async with m.turn(env.ts, ALICE, env.template) as sb:
        await sb.write_file("kept.txt", b"still here")
    await m.sleep(env.ts, ALICE)
    await sweep(m, now=time.time() + 10)
    assert _state(env, ALICE) == "archived"
    async with m.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.read_file("kept.txt") == b"still here"


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_second_manager_finds_the_instance_from_the_store(lc_env: LcEnv) -> None:
    env = lc_env
    first = env.manager(policy=FixedTimeout(3600))
    async with first.turn(env.ts, ALICE, env.template) as sb:
        await sb.write_file("mine.txt", b"written via the first manager")
    rec = env.ts.sandboxes.for_scope(ALICE)
    await first.close()  # detaches; the instance keeps running and the store says where
    second = env.manager(policy=FixedTimeout(3600))
    async with second.turn(env.ts, ALICE, env.template) as sb:
        assert await sb.read_file("mine.txt") == b"written via the first manager"
    assert env.ts.sandboxes.for_scope(ALICE).id == rec.id
    assert second.stats.provisions == 0
    assert len(env.spans("lifecycle.provision")) == 1


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_instance_placed_on_another_host_is_not_served_here(lc_env: LcEnv) -> None:
    env = lc_env
    a = env.manager(policy=FixedTimeout(3600), host_id="host-a")
    await a.ensure_running(env.ts, ALICE, env.template)
    b = env.manager(policy=FixedTimeout(3600), host_id="host-b")
    from moorage.lifecycle.manager import Misplaced

    with pytest.raises(Misplaced) as e:
        await b.ensure_running(env.ts, ALICE, env.template)
    assert e.value.host == "host-a" and "host-a" in (e.value.hint or "")
