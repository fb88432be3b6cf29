"""A deployed agent as an MCP server: the official SDK client initializes, lists tools, calls the tool and
gets the agent's real reply over Streamable HTTP, with an end-user token or a tenant key.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.api.conftest import aclient, agent_archive


def mcp_client(url: str, secret: str, **headers: str) -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {secret}", **headers}, timeout=120)
    return Client(streamable_http_client(url, http_client=http))


async def deploy_with_token(live, admin: str, tmp_path: Path, agent: str = "echo", user: str = "ann") -> str:
    async with aclient(live, admin) as c:
        r = await c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        return (await c.post(f"/v1/agents/{agent}/users/{user}/tokens", json={})).json()["token"]


async def test_end_user_token_runs_a_turn_over_mcp(live_rt, acme: str, tmp_path: Path):
    token = await deploy_with_token(live_rt, acme, tmp_path)
    async with mcp_client(f"{live_rt.url}/mcp/echo", token) as client:
        assert client.server_info is not None and client.server_info.name == "moorage-echo"
        tools = (await client.list_tools()).tools
        assert [t.name for t in tools] == ["send_message"]
        assert tools[0].input_schema["required"] == ["message"]
        result = await client.call_tool("send_message", {"message": "whoami", "session": "s1"})
        assert not result.is_error
        assert result.content[0].text == "user=ann"
        assert result.structured_content["status"] == "done"
        again = await client.call_tool("send_message", {"message": "hello there", "session": "s1"})
        assert again.content[0].text == "echo: hello there"

        # The caller's sessions are resources; reading one shows the real conversation log.
        resources = (await client.list_resources()).resources
        uris = [str(r.uri) for r in resources]
        assert uris == ["moorage://agents/echo/users/ann/sessions/s1"]
        log = (await client.read_resource(uris[0])).contents[0].text
        assert "user: hello there" in log and "assistant: echo: hello there" in log

        # The token pins its user: naming another one is refused inside the tool result.
        refused = await client.call_tool("send_message", {"message": "hi", "user": "bob"})
        assert refused.is_error and "another user" in refused.content[0].text

    # /mcp without an agent serves the token's own agent.
    async with mcp_client(f"{live_rt.url}/mcp", token) as client:
        result = await client.call_tool("send_message", {"message": "ping"})
        assert result.content[0].text == "echo: ping"


async def test_tenant_key_names_the_user(live_rt, acme: str, tmp_path: Path):
    await deploy_with_token(live_rt, acme, tmp_path)
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme) as client:
        missing = await client.call_tool("send_message", {"message": "whoami"})
        assert missing.is_error and "missing user" in missing.content[0].text
        as_arg = await client.call_tool("send_message", {"message": "whoami", "user": "carl"})
        assert as_arg.content[0].text == "user=carl"
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme, **{"X-Moorage-User": "dora"}) as client:
        as_header = await client.call_tool("send_message", {"message": "whoami"})
        assert as_header.content[0].text == "user=dora"


async def test_legacy_handshake_clients_work_too(live_rt, acme: str, tmp_path: Path):
    token = await deploy_with_token(live_rt, acme, tmp_path)
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
    async with Client(streamable_http_client(f"{live_rt.url}/mcp/echo", http_client=http), mode="legacy") as client:
        assert client.protocol_version in ("2025-11-25", "2025-06-18")
        result = await client.call_tool("send_message", {"message": "legacy"})
        assert result.content[0].text == "echo: legacy"
