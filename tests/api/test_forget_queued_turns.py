"""Forgetting a user while turns of theirs wait in line behind a running one: the waiting turns ran after the
forget (an async execution's message run for a user who no longer exists: its run, its reply and a new sandbox,
with no user). Now each is refused once it reaches the instance (409), and nothing of the user is left."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive
from tests.api.test_forget_race import SLOW

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_turns_waiting_behind_a_forget_never_run(live_rt, acme: str, store: Store, tmp_path: Path) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=SLOW), headers=GZ)
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "0", "user": "ada"})).status_code == 200
        running = asyncio.create_task(c.post("/v1/agents/echo/invoke", json={"message": "30", "user": "ada"}))
        await asyncio.sleep(0.5)
        queued = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "0.1", "user": "ada"})
        assert queued.status_code == 202 and queued.json()["status"] == "queued", queued.text
        waiting = asyncio.create_task(c.post("/v1/agents/echo/invoke", json={"message": "0.1", "user": "ada"}))
        await asyncio.sleep(0.3)
        forgot = await c.delete("/v1/agents/echo/users/ada")
        assert forgot.status_code == 200 and forgot.json()["deleted"] is True, forgot.text
        assert (await running).status_code == 409
        refused = await waiting
        assert refused.status_code == 409 and "forgotten" in refused.json()["detail"], refused.text
        await asyncio.sleep(1.5)  # what the queued execution would have run by now
        assert (await c.get(f"/v1/executions/{queued.json()['id']}")).status_code == 404
        assert (await c.get("/v1/workflows", params={"agent": "echo"})).json()["data"] == []
        assert [b.id for b in ts.sandboxes.list() if b.scope.user == "ada"] == []
        assert (await c.get("/v1/agents/echo/users/ada")).status_code == 404
        assert (await c.get("/v1/agents/echo/users/ada/events")).status_code == 404  # no such user now, no log
