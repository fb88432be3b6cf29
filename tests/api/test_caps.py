"""Per-end-user caps over HTTP with the real runtime: awake seconds metered from state changes, a turn over the
compute cap refused with 429 naming the cap and its reset (the instance put to sleep), the metered usage equal
to the awake time the lifecycle recorded, token caps, and the background enforcement of awake instances."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from moorage.store import Scope, Store
from moorage.usage import caps
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_compute_cap_refuses_turns_and_sleeps_the_instance(live_rt, store: Store, acme: str, tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    scope = Scope.for_user("echo", "capped")
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        r = await c.put("/v1/agents/echo/users/capped", json={"limits": {"compute_seconds_per_day": 2}})
        assert r.status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "capped"})).status_code == 200
        assert ts.sandboxes.for_scope(scope).state == "running"  # the default policy keeps it awake for minutes
        while caps.compute_seconds(ts, "echo", "capped", since=caps.day_window(time.time())[0]) < 2:
            await asyncio.sleep(0.05)

        r = await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "capped"})
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["type"].endswith("/cap-exceeded") and "compute_seconds_per_day" in body["detail"]
        reset = caps.day_window(time.time())[1]
        assert "UTC" in body["hint"] and abs(int(r.headers["retry-after"]) - (reset - time.time())) < 5
        assert ts.sandboxes.for_scope(scope).state == "sleeping"  # over its compute cap: put to sleep
        # Other users of the same agent are not affected.
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "free"})).status_code == 200

        usage = (await c.get("/v1/usage", params={"agent": "echo", "user": "capped"})).json()["totals"]
        daily = (await c.get("/v1/usage", params={"agent": "echo", "user": "capped", "group": "day"})).json()["days"]
        assert [d["day"] for d in daily] == [time.strftime("%Y-%m-%d", time.gmtime())]
        assert daily[0]["totals"]["compute_seconds"] == usage["compute_seconds"]
    spans = [s for s in ts.spans.recent(limit=500) if s.attrs.get("scope") == scope.key]
    up = min(s.end_ts for s in spans if s.name in ("lifecycle.provisioned", "lifecycle.woke"))
    down = max(s.end_ts for s in spans if s.name == "lifecycle.slept")
    awake = down - up
    assert awake >= 2 and abs(usage["compute_seconds"] - awake) <= 0.05 * awake, (usage, awake)


async def test_token_caps_and_raising_a_cap(live_rt, store: Store, acme: str, tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.put("/v1/agents/echo/users/talker", json={"limits": {"tokens_per_month": 100}})).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "talker"})).status_code == 200
        # What the LLM gateway's usage sink writes for this user's model calls.
        ts.usage.add("input_tokens", 70, agent_id="echo", user_id="talker")
        ts.usage.add("output_tokens", 40, agent_id="echo", user_id="talker")
        r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "more", "user": "talker"})
        assert r.status_code == 429 and "tokens_per_month" in r.json()["detail"]
        assert int(r.headers["retry-after"]) >= 1
        r = await c.post("/v1/chat/completions", json={"model": "echo", "user": "talker",
                                                       "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 429 and r.headers["retry-after"]
        assert (await c.put("/v1/agents/echo/users/talker", json={"limits": {"tokens_per_month": 1000}})).status_code == 200
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "ok", "user": "talker"})).json()["reply"] == "echo: ok"


async def test_awake_instances_over_the_compute_cap_are_put_to_sleep(live_rt, runtime, store: Store, acme: str,
                                                                     tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    loop = asyncio.create_task(caps.enforce_loop(runtime, every_s=0.05))
    try:
        async with aclient(live_rt, acme) as c:
            assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
            assert (await c.put("/v1/agents/echo/users/idle", json={"limits": {"compute_seconds_per_day": 1}})).status_code == 201
            assert (await c.put("/v1/agents/echo/users/other", json={})).status_code == 201
            for user in ("idle", "other"):
                assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})).status_code == 200
        for _ in range(1200):  # no request comes: the enforcement loop itself finds it over the cap
            if ts.sandboxes.for_scope(Scope.for_user("echo", "idle")).state == "sleeping":
                break
            await asyncio.sleep(0.05)
        assert ts.sandboxes.for_scope(Scope.for_user("echo", "idle")).state == "sleeping"
        assert ts.sandboxes.for_scope(Scope.for_user("echo", "other")).state == "running"  # no cap, stays awake
        assert ts.usage.totals(agent_id="echo", user_id="idle")["compute_seconds"] >= 1
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_an_agent_sets_default_limits_for_its_users(live_rt, store: Store, acme: str, tmp_path: Path):
    import io
    import tarfile

    files = {"moorage.toml": '[agent]\nname = "metered"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                             '[agent.limits]\ncompute_seconds_per_day = 1\n',
             "agent.py": 'async def on_message(ctx, message):\n    return "ok"\n'}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/metered/deployments", content=buf.getvalue(), headers=GZ)).status_code == 201
        # "vip" has a limit of their own, which overrides the agent's default.
        assert (await c.put("/v1/agents/metered/users/vip", json={"limits": {"compute_seconds_per_day": 3600}})).status_code == 201
        for user in ("plain", "vip"):
            assert (await c.post("/v1/agents/metered/invoke", json={"message": "hi", "user": user})).status_code == 200
        while caps.compute_seconds(ts, "metered", "plain", since=caps.day_window(time.time())[0]) < 1:
            await asyncio.sleep(0.05)
        r = await c.post("/v1/agents/metered/invoke", json={"message": "again", "user": "plain"})
        assert r.status_code == 429 and "compute_seconds_per_day (" in r.json()["detail"]
        assert (await c.post("/v1/agents/metered/invoke", json={"message": "again", "user": "vip"})).status_code == 200
