"""A tenant's share of the host's CPU for its guests' calls (runtime/cpu_share.py): the CPU its calls' work uses on
worker threads and on the event loop is charged to that tenant alone, and once past its share its guest's frames
wait unread."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from moorage.runtime import cpu_share, host_calls
from moorage.runtime.activity import TenantActivity
from moorage.sandbox import channel_share
from moorage.store import EntityKey
from tests.runtime.conftest import Env, write_agent


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_the_budget_refills_at_the_share_up_to_the_burst() -> None:
    now = [0.0]
    meter = cpu_share.Meter(0.25, burst_s=0.25, clock=lambda: now[0])
    assert meter.wait_s() == 0.0
    meter.charge(0.75)  # 0.5 s of CPU past the burst: at a quarter core, two seconds to earn back
    assert meter.wait_s() == pytest.approx(2.0)
    now[0] += 1.0
    assert meter.wait_s() == pytest.approx(1.0)
    now[0] += 10.0
    assert meter.wait_s() == 0.0
    meter.charge(0.25)  # refilled to the burst, never past it
    assert meter.wait_s() == 0.0
    meter.charge(0.01)
    assert meter.wait_s() > 0


async def test_worker_cpu_is_charged_to_the_task_that_submitted_it() -> None:
    cpu_share.install(asyncio.get_running_loop())
    a, b = cpu_share.Meter(1.0), cpu_share.Meter(1.0)

    async def work(meter: cpu_share.Meter | None, cpu_s: float) -> None:
        if meter is None:
            await asyncio.to_thread(_burn, cpu_s)
            return
        with cpu_share.metered(meter):
            await asyncio.to_thread(_burn, cpu_s)

    await asyncio.gather(work(a, 0.2), work(b, 0.02), work(None, 0.1), work(a, 0.1))
    assert 0.3 <= a.used_s < 0.4  # its two jobs, not b's nor the unmetered one
    assert 0.02 <= b.used_s < 0.05


HUNGRY = '''
async def on_message(ctx, message):
    for _ in range(int(message)):
        await ctx.memory.facts()
    return "done"
'''


@pytest.mark.parametrize("others", [True, False], ids=["another-tenant-in-a-turn", "alone"])
async def test_a_guest_past_its_tenants_share_waits_while_others_run_and_its_turn_still_completes(
        env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, others: bool) -> None:
    # A share so small that the first calls spend it: while another tenant's turn runs, the rest wait (briefly
    # here) and the turn is slowed, not failed; a tenant alone on the host is never held back.
    env.runtime.config = dataclasses.replace(env.runtime.config, guest_cpu_share=0.0001)
    monkeypatch.setattr(channel_share, "MAX_WAIT_S", 0.005)
    monkeypatch.setattr(cpu_share, "BURST_S", 0.0)
    monkeypatch.setattr(env.runtime.activity, "others_active", lambda tenant_id: others)
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "hungry", HUNGRY))
    r = await env.runtime.invoke(env.principal, EntityKey("hungry", "ada"), "60")
    assert r.reply == "done"
    meter = host_calls._METERS[env.runtime][env.principal.tenant_id]
    assert meter.used_s > 0
    assert (meter.waits > 0) is others


async def test_a_tenant_is_contended_while_another_tenants_turn_runs_and_a_moment_after(env: Env, tmp_path: Path) -> None:
    rt = env.runtime
    _, key = env.store.operator.create_tenant("other")
    other = env.store.authenticate(key.secret)
    slow = "import asyncio\nasync def on_message(ctx, message):\n    await asyncio.sleep(float(message))\n    return 'ok'\n"
    await rt.deploy(env.principal, write_agent(tmp_path / "a", "slow", slow))
    await rt.deploy(other, write_agent(tmp_path / "b", "slow", slow))
    mine, theirs = env.principal.tenant_id, other.tenant_id
    assert not rt.activity.others_active(mine)
    turn = asyncio.get_running_loop().create_task(rt.invoke(env.principal, EntityKey("slow", "ada"), "1.5"))
    for _ in range(200):
        if rt.turns:
            break
        await asyncio.sleep(0.02)
    assert rt.activity.running(mine) == 1
    assert not rt.activity.others_active(mine) and rt.activity.others_active(theirs)  # its own turn is no contention
    assert (await turn).reply == "ok"
    for _ in range(200):  # the reply goes out before the turn's checkpoint; the turn ends after it
        if not rt.turns:
            break
        await asyncio.sleep(0.02)
    assert rt.activity.running() == 0


def test_a_tenant_counts_as_active_for_a_moment_after_its_last_turn() -> None:
    now = [0.0]
    act = TenantActivity(clock=lambda: now[0], recent_s=1.0)
    act.begin("a")
    act.begin("b")
    assert act.others_active("a") and act.others_active("b") and act.others_active("c")
    act.end("b")
    assert act.others_active("b")  # a still runs
    act.end("a")
    assert act.others_active("a") and act.others_active("b") and act.others_active("c")  # both ended just now
    now[0] = 0.5
    for t in ("a", "c"):  # the two newest ends are now c's and a's; b's (at 0) is no longer tracked
        act.begin(t)
        act.end(t)
    now[0] = 1.2
    assert act.others_active("b") and act.others_active("a") and act.others_active("c")  # 0.7 s ago
    now[0] = 1.6
    assert not act.others_active("a") and not act.others_active("b") and not act.others_active("c")
    assert act.running() == 0


def test_an_uncontended_meter_forgives_its_debt() -> None:
    now, busy = [0.0], [False]
    meter = cpu_share.Meter(0.25, burst_s=0.0, clock=lambda: now[0], contended=lambda: busy[0])
    meter.charge(1.0)
    assert meter.wait_s() == 0.0  # alone: never held back
    busy[0] = True
    assert meter.wait_s() == 0.0  # and what it spent alone is not held against it
    meter.charge(0.5)
    assert meter.wait_s() == pytest.approx(2.0)
