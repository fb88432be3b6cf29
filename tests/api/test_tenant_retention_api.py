"""``GET``/``PUT /v1/retention``: the tenant's default TTL per scope kind, read (``read``) and set (``admin``)
over HTTP, validated as a whole before anything is written, applied by the sweeper, invisible to another
tenant and refused to keys limited to one agent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from moorage.store import Scope, Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}
#: A tenant that never set a TTL: everything kept, but traces and webhooks (30 days: DEFAULT_TTLS).
NONE = {"session": None, "user": None, "workflow": None, "executions": None, "usage": None, "traces": 30 * 86400.0,
        "webhooks": 30 * 86400.0}


async def test_tenant_retention_over_http(live_rt, store: Store, acme: str, globex: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c, aclient(live_rt, globex) as g:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.get("/v1/retention")).json() == {"ttl_s": NONE, "agents": []}
        r = await c.put("/v1/retention", json={"ttl_s": {"session": 60, "workflow": 3600}})
        assert r.status_code == 200, r.text
        assert r.json() == {"ttl_s": {**NONE, "session": 60, "workflow": 3600}, "agents": []}
        # An agent with a retention of its own is listed beside the tenant's defaults.
        assert (await c.put("/v1/agents/echo/retention", json={"ttl_s": 30})).status_code == 200
        assert (await c.get("/v1/retention")).json()["agents"] == [{"agent": "echo", "ttl_s": 30, "zero_retention": False}]
        assert (await c.put("/v1/agents/echo/retention", json={"ttl_s": None})).status_code == 200
        # Nothing is written unless every entry is valid.
        for bad in ({"ttl_s": {"session": 10, "events": 5}}, {"ttl_s": {"session": 0}}, {"ttl_s": {"user": "1d"}},
                    {"ttl_s": {}}, {"ttl_s": 60}, {}, {"ttl_s": {"user": 5}, "extra": 1},
                    {"ttl_s": {"user": 5, "usage": 86400}}):  # the ledger must cover a month of caps
            r = await c.put("/v1/retention", json=bad)
            assert r.status_code == 422, (bad, r.text)
        assert (await c.get("/v1/retention")).json()["ttl_s"] == {**NONE, "session": 60, "workflow": 3600}
        # Another tenant's retention is its own.
        assert (await g.get("/v1/retention")).json() == {"ttl_s": NONE, "agents": []}
        assert (await g.put("/v1/retention", json={"ttl_s": {"user": 5}})).status_code == 200
        assert (await c.get("/v1/retention")).json()["ttl_s"]["user"] is None

        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        ts = store.tenant(store.authenticate(acme))
        assert ts.events.list(Scope.session("echo", "ada", "default"))
        store.operator.sweep_all(now=time.time() + 120)
        assert ts.events.list(Scope.session("echo", "ada", "default")) == []  # the tenant's session TTL applied

        # Clearing a kind keeps its data again.
        r = await c.put("/v1/retention", json={"ttl_s": {"session": None}})
        assert r.json()["ttl_s"] == {**NONE, "workflow": 3600}

        # Record kinds: finished executions and the usage ledger, by age.
        r = await c.put("/v1/retention", json={"ttl_s": {"executions": 3600, "usage": 40 * 86400}})
        assert r.status_code == 200 and r.json()["ttl_s"] == {**NONE, "workflow": 3600, "executions": 3600,
                                                              "usage": 40 * 86400}
        ex = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "later", "user": "ada"})
        while (await c.get(ex.headers["location"])).json()["status"] != "succeeded":
            await asyncio.sleep(0.05)
        from moorage.webhooks.delivery import announce

        await asyncio.to_thread(announce, ts)  # the outcome is announced (no webhooks: nothing to send)
        ts.usage.add("input_tokens", 3, agent_id="echo", user_id="ada", ts=time.time() - 41 * 86400)
        store.operator.sweep_all(now=time.time() + 3700)
        assert (await c.get(ex.headers["location"])).status_code == 404
        assert ts.read("SELECT COUNT(*) FROM usage WHERE ts < ?", [time.time() - 40 * 86400])[0][0] == 0

        # Traces: every span by its start (an HTTP request's has no scope; they were kept for ever).
        assert ts.read("SELECT COUNT(*) FROM spans")[0][0] > 0
        r = await c.put("/v1/retention", json={"ttl_s": {"traces": 7 * 86400}})
        assert r.status_code == 200 and r.json()["ttl_s"]["traces"] == 7 * 86400
        store.operator.sweep_all(now=time.time() + 3 * 86400)
        assert ts.read("SELECT COUNT(*) FROM spans WHERE scope IS NULL")[0][0] > 0  # younger than a week: kept
        store.operator.sweep_all(now=time.time() + 8 * 86400)
        assert ts.read("SELECT COUNT(*) FROM spans")[0][0] == 0

        # Scopes: read may read, only admin may set; a key limited to one agent reaches neither.
        read = (await c.post("/v1/keys", json={"scopes": ["read"]})).json()["secret"]
        deploy = (await c.post("/v1/keys", json={"scopes": ["deploy"]})).json()["secret"]
        limited = (await c.post("/v1/keys", json={"scopes": ["read", "deploy"], "agent": "echo"})).json()["secret"]
    async with aclient(live_rt, read) as r_key, aclient(live_rt, deploy) as d_key, aclient(live_rt, limited) as l_key:
        assert (await r_key.get("/v1/retention")).status_code == 200
        assert (await r_key.put("/v1/retention", json={"ttl_s": {"user": 5}})).status_code == 403
        assert (await d_key.put("/v1/retention", json={"ttl_s": {"user": 5}})).status_code == 403
        assert (await l_key.get("/v1/retention")).status_code == 403
        assert (await l_key.get("/v1/agents/echo/retention")).status_code == 200
    async with aclient(live_rt, acme) as c:
        assert (await c.get("/v1/retention")).json()["ttl_s"]["user"] is None
