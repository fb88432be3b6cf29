"""Forgetting a user while a turn of theirs runs: the turn is cancelled and ends before the forget goes on (the
forget destroyed the sandbox under it: the turn's caller got a 502 "sandbox-channel-closed"); its caller gets 409
run-cancelled, the forget answers 200 and nothing of the user is left."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}

SLOW = '''
import asyncio


async def on_message(ctx, message):
    await ctx.step("before", lambda: "b")
    await asyncio.sleep(float(message))
    await ctx.step("after", lambda: "a")
    return "finished " + message
'''


async def _nothing_left(c: httpx.AsyncClient, store: Store, acme: str, user: str) -> None:
    assert (await c.get(f"/v1/agents/echo/users/{user}")).status_code == 404
    assert (await c.get(f"/v1/agents/echo/users/{user}/events")).status_code == 404  # no such user now, no log
    assert (await c.get(f"/v1/agents/echo/users/{user}/checkpoints")).status_code == 404  # no such user now
    # Every earlier user of these tests was forgotten too: no run of the agent is left.
    assert (await c.get("/v1/workflows", params={"agent": "echo"})).json()["data"] == []
    ts = store.tenant(store.authenticate(acme))
    assert [b.id for b in ts.sandboxes.list() if b.scope.user == user] == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_forgetting_a_user_cancels_their_running_turn(live_rt, acme: str, store: Store, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=SLOW), headers=GZ)
        assert r.status_code == 201, r.text
        for i in range(2):
            user = f"leaver{i}"
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "0", "user": user})).status_code == 200
            turn = asyncio.create_task(c.post("/v1/agents/echo/invoke", json={"message": "30", "user": user}))
            await asyncio.sleep(0.4 + 0.2 * i)  # inside the agent's sleep
            t0 = time.monotonic()
            forgot = await c.delete(f"/v1/agents/echo/users/{user}")
            invoked = await turn
            assert forgot.status_code == 200 and forgot.json()["deleted"] is True, forgot.text
            assert time.monotonic() - t0 < 20, "the forget waited for the turn instead of cancelling it"
            assert invoked.status_code == 409 and invoked.json()["type"].endswith("/run-cancelled"), invoked.text
            await _nothing_left(c, store, acme, user)
        # The id is free again: a turn for it starts a new user.
        r = await c.post("/v1/agents/echo/invoke", json={"message": "0", "user": "leaver0"})
        assert r.status_code == 200 and r.json()["reply"] == "finished 0", r.text

