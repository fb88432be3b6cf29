"""Turns started through MCP meet the same per-user caps as HTTP turns: a capped user's ``send_message`` is
refused inside the tool result, naming the cap and when it resets; nothing runs, and other users are served."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from moorage.store import Scope, Store
from moorage.usage import caps
from tests.api.conftest import aclient, agent_archive
from tests.mcp.test_mcp_server import mcp_client

GZ = {"content-type": "application/gzip"}


async def test_mcp_turn_of_a_user_over_the_token_cap_is_refused(live_rt, store: Store, acme: str, tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.put("/v1/agents/echo/users/talker", json={"limits": {"tokens_per_month": 100}})).status_code == 201
        token = (await c.post("/v1/agents/echo/users/talker/tokens", json={})).json()["token"]
    async with mcp_client(f"{live_rt.url}/mcp/echo", token) as client:
        assert (await client.call_tool("send_message", {"message": "hi"})).content[0].text == "echo: hi"
        # What the LLM gateway's usage sink writes for this user's model calls: over the cap now.
        ts.usage.add("input_tokens", 70, agent_id="echo", user_id="talker")
        ts.usage.add("output_tokens", 40, agent_id="echo", user_id="talker")
        runs_before = len(ts.runs.list(limit=100))
        refused = await client.call_tool("send_message", {"message": "more"})
        assert refused.is_error
        text = refused.content[0].text
        assert "tokens_per_month" in text and "resets at" in text, text
        meta = refused.structured_content
        assert meta["error"] == "cap-exceeded" and meta["cap"] == "tokens_per_month"
        assert 1 <= meta["retry_after_s"] <= caps.month_window(time.time())[1] - time.time() + 5
        assert len(ts.runs.list(limit=100)) == runs_before  # nothing was started
    # A tenant key acting for another user of the same agent is not affected.
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme) as client:
        ok = await client.call_tool("send_message", {"message": "hey", "user": "free"})
        assert not ok.is_error and ok.content[0].text == "echo: hey"


async def test_mcp_turn_over_the_compute_cap_is_refused_and_the_instance_sleeps(live_rt, store: Store, acme: str,
                                                                                 tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    scope = Scope.for_user("echo", "busy")
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.put("/v1/agents/echo/users/busy", json={"limits": {"compute_seconds_per_day": 1}})).status_code == 201
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme, **{"X-Moorage-User": "busy"}) as client:
        assert not (await client.call_tool("send_message", {"message": "hi"})).is_error
        assert ts.sandboxes.for_scope(scope).state == "running"
        while caps.compute_seconds(ts, "echo", "busy", since=caps.day_window(time.time())[0]) < 1:
            await asyncio.sleep(0.05)
        refused = await client.call_tool("send_message", {"message": "again"})
        assert refused.is_error and "compute_seconds_per_day" in refused.content[0].text
        assert refused.structured_content["cap"] == "compute_seconds_per_day"
    assert ts.sandboxes.for_scope(scope).state == "sleeping"  # over its compute cap: put to sleep, as over HTTP
