"""The MCP endpoints attacked across tenants and users: another tenant's key or token, the victim's other
user's token, forged headers. Nothing planted by the victim may come back, and the victim's data stays as it was.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive
from tests.api.test_cross_tenant import PLANT, plant_victim, snapshot

HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "MCP-Protocol-Version": "2025-11-25"}


def rpc(method: str, params: dict | None = None, id: int = 1) -> dict:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params or {}}


def assert_clean(r: httpx.Response, victim: dict, what: str) -> None:
    for needle in (PLANT, victim["tenant_id"], *victim["secrets"]):
        assert needle not in r.text, f"{what} leaked victim data: {r.text[:300]}"
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"


async def test_mcp_refuses_other_tenants_and_users(live_rt, store: Store, acme: str, globex: str, tmp_path: Path):
    victim = await plant_victim(live_rt, store, globex, tmp_path)
    before = snapshot(store, globex)
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/aagent/deployments", content=agent_archive(tmp_path, "aagent"),
                             headers={"content-type": "application/gzip"})).status_code == 201
        acme_token = (await c.post("/v1/agents/aagent/users/vuser/tokens", json={})).json()["token"]
    forged = {"X-Tenant-Id": victim["tenant_id"], "X-Moorage-User": "vuser", "X-Moorage-Agent": "vagent"}
    session_uri = "moorage://agents/vagent/users/vuser/sessions/default"
    calls = [rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                "clientInfo": {"name": "attacker", "version": "0"}}),
             rpc("tools/list"), rpc("resources/list"), rpc("resources/read", {"uri": session_uri}),
             rpc("tools/call", {"name": "send_message", "arguments": {"message": "hi", "user": "vuser"}})]
    outsiders = {"other tenant's key": {"Authorization": f"Bearer {acme}", **forged},
                 "other tenant's end-user token": {"Authorization": f"Bearer {acme_token}", **forged},
                 "no credential": forged}
    async with httpx.AsyncClient(base_url=live_rt.url, timeout=120) as c:
        for who, headers in outsiders.items():
            for body in calls:
                r = await c.post("/mcp/vagent", json=body, headers={**HEADERS, **headers})
                what = f"{who}: {body['method']}"
                assert_clean(r, victim, what)
                expected = {"other tenant's key": 404, "other tenant's end-user token": 403, "no credential": 401}[who]
                assert r.status_code == expected, f"{what}: {r.status_code}"
                assert r.headers["content-type"].startswith("application/problem+json")
        # /mcp with the other tenant's token reaches that tenant's own agent only.
        r = await c.post("/mcp", json=calls[4], headers={**HEADERS, **forged, "Authorization": f"Bearer {acme_token}"})
        assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "echo: hi"
        r = await c.post("/mcp", json=calls[3], headers={**HEADERS, "Authorization": f"Bearer {acme}"})
        assert r.status_code == 422  # a tenant key must name the agent

        # The victim's other user may talk to the agent as itself, but never see or act as vuser.
        other = {**HEADERS, **forged, "Authorization": f"Bearer {victim['other_user_token']}"}
        for body in calls:
            r = await c.post("/mcp/vagent", json=body, headers=other)
            assert_clean(r, victim, f"other user: {body['method']}")
        listed = (await c.post("/mcp/vagent", json=calls[2], headers=other)).json()["result"]["resources"]
        assert all("/users/vother/" in res["uri"] for res in listed)
        read = (await c.post("/mcp/vagent", json=calls[3], headers=other)).json()
        assert "error" in read
        acted = (await c.post("/mcp/vagent", json=calls[4], headers=other)).json()["result"]
        assert acted["isError"] is True

    # The official client cannot even open a session with another tenant's key.
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {acme}"}, timeout=60)
    with pytest.raises(ExceptionGroup) as failed:
        async with Client(streamable_http_client(f"{live_rt.url}/mcp/vagent", http_client=http)) as client:
            await client.list_tools()
    # The transport surfaces the 404 as an MCP error: the agent is simply not there for this tenant.
    assert failed.group_contains(MCPError, match="Not Found")
    assert PLANT not in repr(failed.value)
    assert snapshot(store, globex) == before
