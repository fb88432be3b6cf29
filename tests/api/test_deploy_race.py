"""Two deploys of one agent at once: the one sent last (the higher number) is live when both have finished,
whichever finished building first. The older one went live over the newer when its build took longer (the
agent ran its older code until the next deploy), though both callers got 201 and the newer number."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}

# Imported when the deploy builds its template: this version's build takes a second longer.
SLOW_TO_BUILD = '''
import time

time.sleep(1.5)


async def on_message(ctx, message):
    return "old: " + message
'''

QUICK = '''
async def on_message(ctx, message):
    return "new: " + message
'''


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_the_newest_of_two_deploys_at_once_goes_live(live_rt, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        first = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=QUICK), headers=GZ)
        assert first.status_code == 201, first.text
        old = asyncio.create_task(c.post("/v1/agents/echo/deployments",
                                         content=agent_archive(tmp_path, body=SLOW_TO_BUILD, version="-old"),
                                         headers=GZ))
        await asyncio.sleep(0.3)  # sent first: it gets the lower number
        new = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=QUICK, version="-new"),
                           headers=GZ)
        old_r = await old
        assert new.status_code == 201 and old_r.status_code == 201, (new.text, old_r.text)
        assert old_r.json()["number"] < new.json()["number"]
        agent = (await c.get("/v1/agents/echo")).json()
        assert agent["live_deployment"] == new.json()["id"], (agent, old_r.json()["number"], new.json()["number"])
        r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})
        assert r.json()["reply"] == "new: hi", r.text
        # The older one is built and listed: it can still be made live on purpose (a deployment rollback).
        deps = {d["number"]: d["status"] for d in (await c.get("/v1/agents/echo/deployments")).json()["data"]}
        assert deps[old_r.json()["number"]] == "ready", deps
