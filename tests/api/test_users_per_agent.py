"""End-users belong to one agent: a user created for agent A (or auto-created by A's first turn) is no user of
agent B with ``users = "existing"``, over invoke, async invoke, chat completions and MCP alike; an agent with
``users = "auto"`` registers the user with itself on the first turn (listed as its user)."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import aclient, agent_archive
from tests.api.test_users import existing_users_archive
from tests.mcp.test_mcp_server import mcp_client

GZ = {"content-type": "application/gzip"}


async def test_a_user_of_one_agent_is_not_a_user_of_another(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        for name in ("alpha", "beta"):
            r = await c.post(f"/v1/agents/{name}/deployments", content=existing_users_archive(tmp_path, name), headers=GZ)
            assert r.status_code == 201, r.text
        assert (await c.put("/v1/agents/alpha/users/cust-1", json={})).status_code == 201
        assert (await c.post("/v1/agents/alpha/invoke", json={"message": "hi", "user": "cust-1"})).json()["reply"] == "hi cust-1: hi"

        r = await c.post("/v1/agents/beta/invoke", json={"message": "hi", "user": "cust-1"})
        assert r.status_code == 404 and "beta" in r.json()["detail"] and "cust-1" in r.json()["detail"]
        assert "/v1/agents/beta/users/cust-1" in r.json()["hint"]
        assert (await c.post("/v1/agents/beta/invoke?async=true", json={"message": "hi", "user": "cust-1"})).status_code == 404
        r = await c.post("/v1/chat/completions", json={"model": "beta", "user": "cust-1",
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404
        assert (await c.get("/v1/agents/beta/users/cust-1")).status_code == 404
        assert [u["id"] for u in (await c.get("/v1/agents/beta/users")).json()["data"]] == []
        # No share link to beta's app for alpha's user either.
        r = await c.post("/v1/agents/beta/users/cust-1/share-links", json={"ttl_s": 60})
        assert r.status_code == 404 and "no user 'cust-1'" in r.json()["detail"]
    async with mcp_client(f"{live_rt.url}/mcp/beta", acme) as client:
        refused = await client.call_tool("send_message", {"message": "hi", "user": "cust-1"})
        assert refused.is_error and "no user 'cust-1'" in refused.content[0].text
    async with aclient(live_rt, acme) as c:
        # Created for beta too, the same product id now reaches both agents.
        assert (await c.put("/v1/agents/beta/users/cust-1", json={})).status_code == 201
        # A user of beta now, but beta declares no app: no link that could only ever answer 404.
        r = await c.post("/v1/agents/beta/users/cust-1/share-links", json={"ttl_s": 60})
        assert r.status_code == 404 and "serves no app" in r.json()["detail"], r.text
        assert (await c.post("/v1/agents/beta/invoke", json={"message": "yo", "user": "cust-1"})).json()["reply"] == "hi cust-1: yo"
        # Deleting the user from alpha leaves them a user of beta.
        assert (await c.delete("/v1/agents/alpha/users/cust-1")).status_code == 200
        assert (await c.post("/v1/agents/alpha/invoke", json={"message": "hi", "user": "cust-1"})).status_code == 404
        assert (await c.post("/v1/agents/beta/invoke", json={"message": "still", "user": "cust-1"})).status_code == 200


async def test_auto_users_are_registered_with_their_agent_only(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/strict/deployments", content=existing_users_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "walk-in"})).status_code == 200
        # The first turn of an auto agent made the user one of its users (lazy provisioning)...
        assert [u["id"] for u in (await c.get("/v1/agents/echo/users")).json()["data"]] == ["walk-in"]
        assert (await c.get("/v1/agents/echo/users/walk-in")).status_code == 200
        # ... and of no other agent.
        assert (await c.post("/v1/agents/strict/invoke", json={"message": "hi", "user": "walk-in"})).status_code == 404


async def test_cross_tenant_users_do_not_reach_another_tenants_agent(live_rt, acme: str, globex: str, tmp_path: Path):
    async with aclient(live_rt, acme) as a, aclient(live_rt, globex) as g:
        assert (await a.post("/v1/agents/strict/deployments", content=existing_users_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await g.post("/v1/agents/strict/deployments", content=existing_users_archive(tmp_path, "strict"),
                             headers=GZ)).status_code == 201
        assert (await g.put("/v1/agents/strict/users/shared-id", json={})).status_code == 201
        # The same agent name and user id in another tenant: still no user here.
        assert (await a.post("/v1/agents/strict/invoke", json={"message": "hi", "user": "shared-id"})).status_code == 404
        assert (await g.post("/v1/agents/strict/invoke", json={"message": "hi", "user": "shared-id"})).status_code == 200
