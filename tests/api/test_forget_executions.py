"""Deleting an end-user forgets their async turns too: the executions (their messages and streamed events) are gone
(404), none is shown as ``queued`` forever, and none is submitted again when a host starts (which would run a
forgotten user's old message again). Other users' executions stay."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorage.store import Store
from moorage.webhooks.executions import ExecutionRunner
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_deleting_a_user_forgets_their_executions(live_rt, runtime, store: Store, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201

        async def submit(message: str, user: str) -> str:
            r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": message, "user": user})
            assert r.status_code == 202, r.text
            ex_id = r.json()["id"]
            for _ in range(1200):
                status = (await c.get(f"/v1/executions/{ex_id}")).json()["status"]
                if status in ("waiting", "succeeded"):
                    return ex_id
                await asyncio.sleep(0.05)
            raise AssertionError(f"execution {ex_id} is still {status}")

        waiting = await submit("approve", "leaver")
        done = await submit("my private notes", "leaver")
        kept = await submit("hello", "stayer")
        assert (await c.delete("/v1/agents/echo/users/leaver")).json()["deleted"] is True
        for ex_id in (waiting, done):
            r = await c.get(f"/v1/executions/{ex_id}")
            assert r.status_code == 404, r.text
        assert (await c.get(f"/v1/executions/{kept}")).json()["status"] == "succeeded"
    ts = store.tenant(store.authenticate(acme))
    assert {e.user for e in ts.executions.unsettled()} <= {"stayer"}
    # What a host does as it starts: nothing of the forgotten user is run again.
    assert await ExecutionRunner.of(runtime).resubmit_orphans(store, min_age_s=0.0) == 0
