"""A host that runs for weeks must not keep anything per end-user after they are forgotten: users come and go by
the million over its life. Found by the soak run (bench/soak): for every sandbox ever woken the host kept the id
of the deployment loaded in it and a directory lock, forget or not."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.store import Store
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401 - fixtures

GZ = {"content-type": "application/gzip"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_forgotten_users_leave_nothing_in_the_hosts_memory(live_rt, runtime, store: Store, acme: str,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    held = {"deployment loaded per sandbox": lambda: len(runtime._loaded),
            "directory locks per sandbox": lambda: len(runtime.instances._dir_locks)}
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        before = {k: f() for k, f in held.items()}
        for i in range(4):
            user = f"u{i}"
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})).status_code == 200
            sid = (await c.get(f"/v1/agents/echo/users/{user}")).json()["instance"]["sandbox_id"]
            assert (await c.post(f"/v1/sandboxes/{sid}/sleep", json={})).json()["slept"]
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": user})).status_code == 200
            assert (await c.delete(f"/v1/agents/echo/users/{user}")).status_code == 200
        after = {k: f() for k, f in held.items()}
    assert after == before, f"the host still holds entries of 4 forgotten users: {before} -> {after}"
