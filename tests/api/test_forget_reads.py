"""Forgetting one user reads their instances only: on a host with many users, DELETE /v1/agents/{agent}/users/{user}
read every instance of the agent (twice) to find the user's (50,000 of them: seconds per forget)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moorage.store import Store
from moorage.store.model import Scope
from moorage.store.sql import Conn
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_forgetting_a_user_reads_only_their_instances(live_rt, acme: str, store: Store, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "alice"})).status_code == 200
        for i in range(40):  # other users' instances, asleep
            ts.sandboxes.create(Scope.for_user("echo", f"other-{i:02d}"), state="sleeping")
        ts.sandboxes.create(Scope("session", "echo", "alice-2", "s1"), state="sleeping")  # a user named alike

        rows_read: list[int] = []
        orig = Conn.q

        def q(self: Conn, sql: str, params: Any = ()) -> list[tuple]:
            out = orig(self, sql, params)
            if "FROM sandboxes" in sql:
                rows_read.append(len(out))
            return out

        monkeypatch.setattr(Conn, "q", q)
        r = await c.delete("/v1/agents/echo/users/alice")
        monkeypatch.undo()
        assert r.status_code == 200, r.text
        assert sum(rows_read) <= 6, rows_read  # alice's one instance, read a few times: never the other 41
        left = ts.sandboxes.list(agent_id="echo")
        assert {b.scope.user for b in left} == {f"other-{i:02d}" for i in range(40)} | {"alice-2"}
