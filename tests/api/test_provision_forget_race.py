"""Creating an end-user with ``?provision=true`` while the same user is forgotten: the forget ran between the
registration and the provisioning, leaving a sandbox of a user it had deleted (the PUT said 201), or deleted the
sandbox as it was provisioned (the PUT said 404 "no sandbox"), and said ``deleted: false`` of a user it deleted.
Now one runs wholly before the other, and the answers say which."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_provision_and_forget_at_once_agree(live_rt, acme: str, store: Store, tmp_path: Path) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        for i in range(4):
            user = f"early{i}"
            calls = [c.put(f"/v1/agents/echo/users/{user}", params={"provision": "true"}, json={}),
                     c.delete(f"/v1/agents/echo/users/{user}")]
            if i % 2:
                calls.reverse()
            made, forgot = await asyncio.gather(*calls)
            if i % 2:
                made, forgot = forgot, made
            assert made.status_code == 201, made.text
            assert forgot.status_code == 200, forgot.text
            boxes = [b for b in ts.sandboxes.list() if b.scope.user == user]
            if forgot.json()["deleted"]:  # the forget came second: nothing of the user is left
                assert (await c.get(f"/v1/agents/echo/users/{user}")).status_code == 404
                assert boxes == []
            else:  # it came first, finding nobody: the user is there with their provisioned instance
                got = (await c.get(f"/v1/agents/echo/users/{user}")).json()
                assert [b.state for b in boxes] == ["sleeping"], boxes
                assert got["instance"]["sandbox_id"] == boxes[0].id, got
