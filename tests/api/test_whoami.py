"""GET /v1/whoami: what the caller's own credential may do (the dashboard offers only that), for every kind of
credential, answering only about the caller (never another key, user or tenant)."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import acme, aclient, agent_archive, globex, live_rt, runtime  # noqa: F401 - fixtures


async def test_whoami_tells_each_credential_its_own_scopes_agent_and_user(live_rt, acme: str, globex: str,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as admin:
        r = await admin.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                             headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        me = (await admin.get("/v1/whoami")).json()
        assert me["kind"] == "key" and "admin" in me["scopes"] and me["agent"] is None and me["user"] is None
        ro = (await admin.post("/v1/keys", json={"scopes": ["read"]})).json()
        limited = (await admin.post("/v1/keys", json={"scopes": ["invoke"], "agent": "echo"})).json()
        token = (await admin.post("/v1/agents/echo/users/ada/tokens", json={})).json()["token"]
    async with aclient(live_rt, ro["secret"]) as c:
        assert (await c.get("/v1/whoami")).json() == {"kind": "key", "key_id": ro["id"], "scopes": ["read"],
                                                      "agent": None, "user": None}
    async with aclient(live_rt, limited["secret"]) as c:  # a key limited to one agent may ask too
        assert (await c.get("/v1/whoami")).json() == {"kind": "key", "key_id": limited["id"], "scopes": ["invoke"],
                                                      "agent": "echo", "user": None}
    async with aclient(live_rt, token) as c:
        me = (await c.get("/v1/whoami")).json()
        assert me["kind"] == "end-user" and me["agent"] == "echo" and me["user"] == "ada" and me["scopes"] == []
    async with aclient(live_rt, globex) as c:  # another tenant's key: itself only
        other = (await c.get("/v1/whoami")).json()
        assert other["key_id"] not in (ro["id"], limited["id"], me["key_id"])
    async with aclient(live_rt, None) as c:
        assert (await c.get("/v1/whoami")).status_code == 401
