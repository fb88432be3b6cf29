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


async def test_a_queued_execution_is_cancelled_by_its_id_and_never_runs(live_rt, runtime, store, acme: str,
                                                                         tmp_path: Path):
    """An async turn waiting to be tried again (refused for now) has no run (``run_id`` null): cancelling it by its
    execution id, with the route that cancels runs, works; it reads ``cancelled``, never runs, and is announced as
    ``execution.cancelled``. One already in its session's line is a 409 saying to cancel it once started."""
    from moorage.webhooks.delivery import announce

    runtime.router.max_session_queue = 0  # a second turn of one session waiting is refused as overloaded
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/slow/deployments", content=archive(tmp_path, "slow", SLOW.replace("0.3", "2")),
                             headers=GZ)).status_code == 201
        hook = (await c.post("/v1/agents/slow/webhooks", json={"url": "https://example.com/hooks"})).json()
        first = (await c.post("/v1/agents/slow/invoke?async=true", json={"message": "first", "user": "ann"})).json()
        while (await c.get(f"/v1/executions/{first['id']}")).json()["status"] != "running":
            await asyncio.sleep(0.05)
        second = (await c.post("/v1/agents/slow/invoke?async=true", json={"message": "second", "user": "ann"})).json()
        await asyncio.sleep(0.3)  # refused at once, it waits to be tried again
        queued = (await c.get(f"/v1/executions/{second['id']}")).json()
        assert queued["status"] == "queued" and queued["run_id"] is None
        r = await c.post(f"/v1/workflows/{second['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        again = await c.post(f"/v1/workflows/{second['id']}/cancel")
        assert again.status_code == 409, again.text
        while (await c.get(f"/v1/executions/{first['id']}")).json()["status"] != "succeeded":
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.5)  # past its next try: it is not tried again
        shown = (await c.get(f"/v1/executions/{second['id']}")).json()
        assert shown["status"] == "cancelled" and shown["reply"] is None and shown["run_id"] is None
        assert (await c.post("/v1/workflows/nothing-here/cancel")).status_code == 404
    ts = store.tenant(store.authenticate(acme))
    assert [r.input["message"] for r in ts.runs.list(limit=10)] == ["first"]  # the second never ran
    announce(ts)
    events = {d.payload["data"]["execution_id"]: d.payload["type"] for d in ts.deliveries.list(hook["id"])}
    assert events == {first["id"]: "execution.succeeded", second["id"]: "execution.cancelled"}
