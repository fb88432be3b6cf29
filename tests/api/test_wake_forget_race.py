"""Waking a user's sandbox while the user is forgotten: the wake ran beside the forget and either failed with a
503 "could not wake" (the forget deleted the snapshot it was waking from) or answered 200 "running" for a sandbox
the forget had just deleted. Now one waits for the other: the wake either ran first (200) or finds the sandbox
gone (404), the forget answers 200, and nothing of the user is left."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_wake_and_forget_at_once_leave_nothing_of_the_user(live_rt, acme: str, store: Store,
                                                                 tmp_path: Path) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        for i in range(4):
            user = f"sleeper{i}"
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})).status_code == 200
            (sandbox_id,) = [b.id for b in ts.sandboxes.list() if b.scope.user == user]
            assert (await c.post(f"/v1/sandboxes/{sandbox_id}/sleep")).json()["slept"] is True
            calls = [c.post(f"/v1/sandboxes/{sandbox_id}/wake"), c.delete(f"/v1/agents/echo/users/{user}")]
            if i % 2:
                calls.reverse()
            woken, forgot = await asyncio.gather(*calls)
            if i % 2:
                woken, forgot = forgot, woken
            assert forgot.status_code == 200 and forgot.json()["deleted"] is True, forgot.text
            if woken.status_code == 200:  # it woke before the forget, which then deleted it
                assert woken.json()["state"] == "running", woken.text
            else:
                assert woken.status_code == 404, woken.text  # it came after the forget: no such sandbox
            assert (await c.get(f"/v1/sandboxes/{sandbox_id}")).status_code == 404
            assert [b.id for b in ts.sandboxes.list() if b.scope.user == user] == []
            assert (await c.get(f"/v1/agents/echo/users/{user}")).status_code == 404
