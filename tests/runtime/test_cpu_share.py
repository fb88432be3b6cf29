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


async def test_a_guest_past_its_tenants_share_waits_and_its_turn_still_completes(env: Env, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A share so small that the first calls spend it: the rest wait (briefly here), the turn is slowed, not failed.
    env.runtime.config = dataclasses.replace(env.runtime.config, guest_cpu_share=0.0001)
    monkeypatch.setattr(channel_share, "MAX_WAIT_S", 0.005)
    monkeypatch.setattr(cpu_share, "BURST_S", 0.0)
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "hungry", HUNGRY))
    r = await env.runtime.invoke(env.principal, EntityKey("hungry", "ada"), "60")
    assert r.reply == "done"
    meter = host_calls._METERS[env.runtime][env.principal.tenant_id]
    assert meter.used_s > 0 and meter.waits > 0
