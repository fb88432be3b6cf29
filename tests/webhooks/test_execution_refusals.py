"""An accepted async turn (202) is not lost to a "not now" refusal met when it runs (the session's queue full,
every awake instance busy): it stays ``queued``, is tried again after the wait the refusal names, and runs, as the
SDK does for a synchronous turn. A refusal that is final still fails it (covered in tests/api)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.api.conftest import aclient
from tests.api.test_retry_after import archive

GZ = {"content-type": "application/gzip"}
SLOW = '''
import asyncio

async def on_message(ctx, message):
    await asyncio.sleep(0.3)
    return "done: " + message
'''


async def test_executions_refused_as_overloaded_wait_and_run(live_rt, runtime, acme: str, tmp_path: Path):
    runtime.router.max_session_queue = 1  # a third turn of one session waiting is refused as overloaded
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/slow/deployments", content=archive(tmp_path, "slow", SLOW),
                             headers=GZ)).status_code == 201
        ids = []
        for i in range(5):
            r = await c.post("/v1/agents/slow/invoke?async=true", json={"message": f"m{i}", "user": "ann"})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        seen: dict[str, dict] = {}
        for _ in range(1200):
            for ex_id in ids:
                seen[ex_id] = (await c.get(f"/v1/executions/{ex_id}")).json()
            if all(e["status"] in ("succeeded", "failed") for e in seen.values()):
                break
            await asyncio.sleep(0.1)
    assert sorted((e["status"], e["reply"]) for e in seen.values()) == [("succeeded", f"done: m{i}") for i in range(5)]
