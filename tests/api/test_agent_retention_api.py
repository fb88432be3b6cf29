"""``GET``/``PUT /v1/agents/{agent}/retention``: an agent's own TTL read and set over HTTP, validated, and
applied by the sweeper to that agent's data only."""

from __future__ import annotations

import time
from pathlib import Path

from moorage.store import Scope, Store
from tests.api.conftest import aclient, agent_archive


async def test_agent_retention_over_http(live_rt, store: Store, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        for name in ("brief", "keeper"):
            r = await c.post(f"/v1/agents/{name}/deployments", content=agent_archive(tmp_path / name, name),
                             headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
        assert (await c.get("/v1/agents/brief/retention")).json() == {"agent": "brief", "ttl_s": None, "zero_retention": False}
        r = await c.put("/v1/agents/brief/retention", json={"ttl_s": 60})
        assert r.status_code == 200 and r.json() == {"agent": "brief", "ttl_s": 60, "zero_retention": False}, r.text
        assert (await c.get("/v1/agents/brief/retention")).json()["ttl_s"] == 60
        for bad in ({"ttl_s": 0}, {"ttl_s": -1}, {"ttl_s": "1d"}, {}):
            r = await c.put("/v1/agents/brief/retention", json=bad)
            assert r.status_code == 422, (bad, r.text)
        assert (await c.get("/v1/agents/nobody/retention")).status_code == 404
        for name in ("brief", "keeper"):
            r = await c.post(f"/v1/agents/{name}/invoke", json={"message": "hi", "user": "ada"})
            assert r.status_code == 200, r.text
    ts = store.tenant(store.authenticate(acme))
    assert ts.events.list(Scope.session("brief", "ada", "default"))
    store.operator.sweep_all(now=time.time() + 120)
    assert ts.events.list(Scope.session("brief", "ada", "default")) == []
    assert ts.events.list(Scope.session("keeper", "ada", "default"))
    async with aclient(live_rt, acme) as c:
        r = await c.put("/v1/agents/brief/retention", json={"ttl_s": None})
        assert r.json() == {"agent": "brief", "ttl_s": None, "zero_retention": False}
