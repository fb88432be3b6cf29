"""An answer and a cancel sent at once to a waiting run (a person approving while a backend gives up): one of them
wins, the other is a clear 409, and the run ends in one state (never a 500, never answered and cancelled both)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from tests.api.conftest import aclient
from tests.api.test_turns import deploy

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_answer_and_cancel_at_once_leave_one_outcome(live_rt, acme, tmp_path: Path) -> None:  # noqa: ANN001
    outcomes: Counter[str] = Counter()
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        for i in range(12):
            r = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": f"u{i}"})).json()
            assert r["status"] == "waiting", r
            run_id = r["run_id"]
            calls = [c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"}),
                     c.post(f"/v1/workflows/{run_id}/cancel")]
            if i % 2:
                calls.reverse()
            answered, cancelled = await asyncio.gather(*calls)
            if i % 2:
                answered, cancelled = cancelled, answered
            assert answered.status_code in (200, 409), answered.text
            assert cancelled.status_code in (200, 409), cancelled.text
            final = (await c.get(f"/v1/workflows/{run_id}")).json()["run"]
            if answered.status_code == 200:
                assert answered.json()["reply"] == "draft-1 -> yes" and final["status"] == "succeeded", final
                assert cancelled.status_code == 409, (cancelled.json()["status"], final["status"])
                outcomes["answered"] += 1
            else:
                # The answer came too late: the run stays cancelled, nothing after the interrupt ran.
                assert cancelled.status_code == 200 and final["status"] == "cancelled", (final, cancelled.text)
                assert answered.json()["type"].rsplit("/", 1)[-1] in ("run-cancelled", "run-not-waiting", "conflict")
                assert final["result"] is None
                outcomes["cancelled"] += 1
    assert sum(outcomes.values()) == 12
