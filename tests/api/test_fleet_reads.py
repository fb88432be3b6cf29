"""GET /v1/fleet (the dashboard's home and agent pages) reads the page of instances it shows and the few the figures
need one by one, and has the store count the rest: it read every instance of the tenant (50,000 of them: seconds
per page view) to count them and sum their asleep seconds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from moorage.store import Store
from moorage.store.model import Scope
from moorage.store.sql import Conn
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_the_fleet_view_counts_instances_without_reading_them(live_rt, acme: str, store: Store, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "alice"})).status_code == 200
        since = time.time() - 60
        asleep = [ts.sandboxes.create(Scope.for_user("echo", f"other-{i:02d}"), state="sleeping") for i in range(40)]

        rows_read: list[int] = []
        orig = Conn.q

        def q(self: Conn, sql: str, params: Any = ()) -> list[tuple]:
            out = orig(self, sql, params)
            if "FROM sandboxes" in sql and "COUNT(*)" not in sql and "SUM(" not in sql:
                rows_read.append(len(out))
            return out

        monkeypatch.setattr(Conn, "q", q)
        r = await c.get(f"/v1/fleet?limit=5&since={since}")
        monkeypatch.undo()
        assert r.status_code == 200, r.text
        fleet = r.json()
        assert fleet["total"] == 41 and fleet["counts"]["sleeping"] == 40 and fleet["truncated"] is True
        newest = sorted([*asleep, *ts.sandboxes.of_user("echo", "alice")], key=lambda b: (b.last_active, b.id))[-5:]
        assert [i["id"] for i in fleet["instances"]] == [b.id for b in reversed(newest)]
        # The asleep seconds of the 40 (alice's instance is awake): each since it was created.
        expected = sum(fleet["generated_at"] - max(since, b.created_at) for b in asleep)
        assert fleet["cost"]["asleep_s"] == pytest.approx(expected, abs=0.01)
        # The 5 shown, alice's (awake, and in the lifecycle spans): never the 40 others all at once.
        assert sum(rows_read) <= 10, rows_read
