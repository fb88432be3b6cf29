"""A page of GET /v1/agents/{agent}/users costs the same few queries however many users it holds: the agent and
the page's instances are read once for the page, not once per user (a page of 200 cost 400 queries; the
dashboard's agent page asks for 200)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moorage.store import Store
from moorage.store.model import Scope
from moorage.store.sql import Conn
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_a_page_of_users_reads_their_instances_in_one_query(live_rt, acme: str, store: Store, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        for i in range(60):
            ts.agent_users.put("echo", f"cust-{i:02d}", meta={"n": i})
        # Every other user has an instance (asleep), as after their first turns.
        boxes = {f"cust-{i:02d}": ts.sandboxes.create(Scope.for_user("echo", f"cust-{i:02d}"), state="sleeping").id
                 for i in range(0, 60, 2)}

        counted: list[str] = []
        for name in ("q", "one", "x"):
            orig = getattr(Conn, name)

            def wrapped(self: Conn, sql: str, params: Any = (), _orig: Any = orig) -> Any:
                counted.append(sql)
                return _orig(self, sql, params)

            monkeypatch.setattr(Conn, name, wrapped)
        page = await c.get("/v1/agents/echo/users?limit=50")
        monkeypatch.undo()
        assert page.status_code == 200, page.text
        users = page.json()["data"]
        assert len(users) == 50
        # The instance of each user as GET of that one user shows it.
        assert {u["id"]: (u["instance"] or {}).get("sandbox_id") for u in users} == \
               {f"cust-{i:02d}": boxes.get(f"cust-{i:02d}") for i in range(50)}
        one = (await c.get("/v1/agents/echo/users/cust-04")).json()
        assert one == next(u for u in users if u["id"] == "cust-04")
        # The key, the agent, the page and its instances (and whatever a background loop ran meanwhile): not 2 a user.
        assert len(counted) < 20, counted
