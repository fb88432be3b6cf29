"""An instance's awake time ends at its snapshot: a sleep the store took only later (its disk full at exactly that
write, SQLite's own error, then room again) billed the wait as awake seconds, since the ledger row measured up to
the moment the record was finally written."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.observability.conftest import archive, start_host


async def test_a_sleep_recorded_late_bills_the_awake_time_up_to_the_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.lifecycle.sleeping import Sleeping

    real, refused = Sleeping._mark_slept, []

    def mark_slept(self, *args, **kw):  # type: ignore[no-untyped-def]
        if len(refused) < 3:  # full for about three seconds: the host tries again every second
            refused.append(time.time())
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, *args, **kw)

    monkeypatch.setattr(Sleeping, "_mark_slept", mark_slept)
    async with start_host(tmp_path) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=60,
                                     headers={"Authorization": f"Bearer {live.key}"}) as c:
            r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
            woke = time.time()
            await asyncio.sleep(0.5)
            (box,) = (await c.get("/v1/sandboxes")).json()["data"]
            asked = time.time()
            r = await c.post(f"/v1/sandboxes/{box['id']}/sleep")
            assert r.status_code == 507, r.text  # slept, but not recorded yet
            answered = time.time()
            deadline = time.time() + 30
            while "compute_seconds" not in (totals := (await c.get("/v1/usage", params={"agent": "echo", "user": "ada"}))
                                            .json()["totals"]):
                assert time.time() < deadline, "the sleep was never recorded"
                await asyncio.sleep(0.2)
            recorded = time.time()
    assert len(refused) == 3 and recorded - answered >= 2.0
    # Its wake to its snapshot: about half a second here; the three seconds the record waited are not awake time.
    assert totals["compute_seconds"] <= answered - woke + 1.0 <= recorded - woke - 1.0, (totals, asked - woke)
