"""Cancelling a turn while it runs: the agent's turn is cancelled in its sandbox at once (it ran on to its next
journal write), the run stays ``cancelled`` (it was recorded ``failed`` over the cancel), the caller of the turn
gets a 409 saying it was cancelled (it got a 502 "agent error" naming an internal conflict), and nothing the agent
would have journaled or replied after the cancel is recorded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio

SLOW = '''
import asyncio


async def on_message(ctx, message):
    await ctx.step("before", lambda: "b")
    await asyncio.sleep(float(message))
    await ctx.step("after", lambda: "a")
    return "finished"
'''

QUIET = '''
import asyncio


async def on_message(ctx, message):
    await ctx.step("before", lambda: "b")
    await asyncio.sleep(float(message))
    return "finished without another step"
'''


async def _cancel_while_running(c, body: str, tmp_path: Path) -> tuple[object, object, dict]:  # noqa: ANN001
    r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=body),
                     headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text
    turn = asyncio.create_task(c.post("/v1/agents/echo/invoke", json={"message": "8", "user": "ada"}))
    for _ in range(200):
        running = (await c.get("/v1/workflows", params={"status": "running", "agent": "echo"})).json()["data"]
        if running:
            break
        await asyncio.sleep(0.05)
    (run,) = running
    await asyncio.sleep(0.5)  # inside the agent's sleep, after its first step
    t0 = time.monotonic()
    cancelled = await c.post(f"/v1/workflows/{run['id']}/cancel")
    invoked = await turn
    # The agent's 8 s sleep was cut short in its sandbox: the turn ended soon after the cancel.
    assert time.monotonic() - t0 < 4, f"the turn ran on for {time.monotonic() - t0:.1f} s after its cancel"
    detail = (await c.get(f"/v1/workflows/{run['id']}")).json()
    return cancelled, invoked, detail


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize("body", [SLOW, QUIET], ids=["journals-after", "replies-after"])
async def test_a_turn_cancelled_while_it_runs_stays_cancelled(live_rt, acme, tmp_path: Path, body: str) -> None:  # noqa: ANN001
    async with aclient(live_rt, acme) as c:
        cancelled, invoked, detail = await _cancel_while_running(c, body, tmp_path)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert invoked.status_code == 409, invoked.text
        assert invoked.json()["type"].endswith("/run-cancelled"), invoked.text
        assert detail["run"]["status"] == "cancelled", detail["run"]
        assert detail["run"]["result"] is None
        assert [s["name"] for s in detail["steps"]] == ["before"]  # "after" was never recorded
        # The reply was not kept as the assistant's message either.
        events = (await c.get("/v1/agents/echo/users/ada/events", params={"session": "default"})).json()["data"]
        assert [e["content"] for e in events] == ["8"], events
        # The instance is still usable after its turn was cut short in the guest.
        r = await c.post("/v1/agents/echo/invoke", json={"message": "0", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"].startswith("finished"), r.text
