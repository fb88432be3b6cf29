"""The operator's per-tenant ``tokens_per_month`` (LLM policy) counted fleet-wide: turns are refused once the
tenant's model tokens in the shared usage ledger — written by any host — reach it (429 naming the cap, with
Retry-After), over HTTP and MCP alike; another tenant is not affected. The gateway's own budget counts only
its host process's calls and starts from zero after a restart; this one reads the store."""

from __future__ import annotations

import time
from pathlib import Path

from moorage.llm.policy import PolicyResolver, parse_policy
from moorage.store import Store
from moorage.usage import caps
from tests.api.conftest import aclient, agent_archive
from tests.mcp.test_mcp_server import mcp_client

GZ = {"content-type": "application/gzip"}


async def test_tenant_token_budget_counts_every_hosts_usage(live_rt, runtime, store: Store, acme: str, globex: str,
                                                           tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    names = {ts.tenant_id: "acme"}
    runtime.llm.policy = PolicyResolver(parse_policy({"llm": {"tenants": {"acme": {"tokens_per_month": 100}}}}),
                                        names.get)
    async with aclient(live_rt, acme) as c, aclient(live_rt, globex) as g:
        for client in (c, g):
            assert (await client.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                                       headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ann"})).status_code == 200
        # What another host's usage sink writes for this tenant's model calls (this process made none).
        ts.usage.add("input_tokens", 60, agent_id="echo", user_id="bob")
        ts.usage.add("output_tokens", 45, agent_id="echo", user_id="bob")
        r = await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "ann"})
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["type"].endswith("/budget-exceeded") and "tokens_per_month" in body["detail"]
        assert "105 of 100" in body["detail"]
        assert abs(int(r.headers["retry-after"]) - caps.TENANT_BUDGET_WINDOW_S) < 60
        r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "later", "user": "ann"})
        assert r.status_code == 429
        # Another tenant (no budget in the policy) is served.
        assert (await g.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ann"})).status_code == 200
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme, **{"X-Moorage-User": "ann"}) as client:
        refused = await client.call_tool("send_message", {"message": "hi"})
        assert refused.is_error and refused.structured_content["cap"] == "tokens_per_month"
        assert refused.structured_content["error"] == "budget-exceeded"


def test_usage_older_than_the_window_does_not_count(store: Store, acme: str):
    ts = store.tenant(store.authenticate(acme))
    now = time.time()
    ts.usage.add("input_tokens", 500, agent_id="echo", user_id="ann", ts=now - caps.TENANT_BUDGET_WINDOW_S - 10)
    ts.usage.add("output_tokens", 10, agent_id="echo", user_id="ann", ts=now - 3600)
    caps.check_tenant_budget(ts, 100, now=now)  # the 500 old tokens have left the window: 10 < 100
    try:
        caps.check_tenant_budget(ts, 10, now=now)
    except caps.TenantBudgetExceeded as e:
        assert e.used == 10 and e.limit == 10
        # It resets when the counted usage (an hour old) leaves the window.
        assert abs(e.retry_after - (caps.TENANT_BUDGET_WINDOW_S - 3600)) < 5
    else:
        raise AssertionError("10 tokens within the window reach a budget of 10")
