"""Disk, snapshot and checkpoint bytes in usage: measured as each instance sleeps, per agent and end-user, by day;
shown by /v1/usage as levels (the latest per instance), not as the sum of every sleep's measurement; counted under
the tenant's storage ceiling. Process driver."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Scope, Store
from moorage.usage import tenant_cap
from tests.api.conftest import aclient, agent_archive


async def test_sleep_records_disk_and_snapshot_bytes(live_rt, store: Store, globex: str, tmp_path: Path):
    runtime = live_rt.app.state.moorage.runtime
    async with aclient(live_rt, globex) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                             headers={"content-type": "application/gzip"})).status_code == 201
        sids = {}
        for user in ("u1", "u2"):
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})).status_code == 200
            sids[user] = store.tenant(store.authenticate(globex)).sandboxes.for_scope(Scope.for_user("echo", user)).id
        # u1 writes 3 MB to its disk and checkpoints its instance (the process driver copies its layer); u2
        # writes nothing.
        r = await c.post(f"/v1/sandboxes/{sids['u1']}/exec",
                         json={"argv": ["sh", "-c", "head -c 3000000 /dev/urandom > blob; sync"]})
        assert r.json()["exit_code"] == 0
        assert (await c.post(f"/v1/sandboxes/{sids['u1']}/checkpoint", json={})).status_code == 200

        async def sleep_and_measure(user: str) -> dict[str, int]:
            assert (await c.post(f"/v1/sandboxes/{sids[user]}/sleep")).json()["slept"] is True
            st = await (await runtime.driver.open(sids[user])).stats()
            return {"disk_bytes": st.disk_bytes, "snapshot_bytes": st.snapshot_bytes,
                    "checkpoint_bytes": st.checkpoint_bytes}

        sizes = {u: await sleep_and_measure(u) for u in ("u1", "u2")}
        assert sizes["u1"]["disk_bytes"] >= 3_000_000 > sizes["u2"]["disk_bytes"]
        assert sizes["u1"]["checkpoint_bytes"] >= 3_000_000 > sizes["u2"]["checkpoint_bytes"]

        for user in ("u1", "u2"):
            totals = (await c.get("/v1/usage", params={"agent": "echo", "user": user})).json()["totals"]
            assert {k: totals[k] for k in sizes[user]} == sizes[user]
        both = (await c.get("/v1/usage", params={"agent": "echo"})).json()["totals"]
        for kind in sizes["u1"]:
            assert both[kind] == sizes["u1"][kind] + sizes["u2"][kind], kind
        # The tenant's storage ceiling counts all three levels with its store.
        ts = store.tenant(store.authenticate(globex))
        assert tenant_cap.measure(ts)["instances"] == sum(sum(s.values()) for s in sizes.values())

        # A second wake and sleep of u1 replaces its level: usage shows the latest bytes, not the sum of both sleeps.
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "u1"})).status_code == 200
        assert (await c.post(f"/v1/sandboxes/{sids['u1']}/exec", json={"argv": ["rm", "blob"]})).json()["exit_code"] == 0
        later = await sleep_and_measure("u1")
        assert later["disk_bytes"] < 3_000_000
        body = (await c.get("/v1/usage", params={"agent": "echo", "user": "u1", "group": "day"})).json()
        assert body["totals"]["disk_bytes"] == later["disk_bytes"]
        assert len(body["days"]) == 1 and body["days"][0]["totals"]["disk_bytes"] == later["disk_bytes"]
        assert body["days"][0]["totals"]["compute_seconds"] > 0  # sums still sum alongside
        # The dashboard's /v1/fleet says the same: levels, each instance's latest.
        fleet = (await c.get("/v1/fleet", params={"agent": "echo"})).json()["usage"]
        assert fleet["disk_bytes"] == later["disk_bytes"] + sizes["u2"]["disk_bytes"]

    ts = store.tenant(store.authenticate(globex))
    rows = [e for e in ts.usage.entries(limit=1000) if e.kind == "disk_bytes"]
    assert sorted(e.user_id for e in rows) == ["u1", "u1", "u2"]  # one row per sleep, per end-user
