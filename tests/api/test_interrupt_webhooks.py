"""``interrupt.waiting`` is sent for any turn that stops for a human answer, as docs/api.md says: native invoke,
OpenAI chat completions (plain and streamed) and MCP ``send_message`` alike, once per turn (a request asked again
with its Idempotency-Key is not a second event), each with the fields of an async turn's events."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import aclient, agent_archive
from tests.mcp.test_mcp_server import mcp_client
from tests.webhooks.test_payloads import FIELDS

GZ = {"content-type": "application/gzip"}


async def test_every_turn_path_that_waits_for_a_human_sends_interrupt_waiting(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        hook = (await c.post("/v1/agents/echo/webhooks", json={"url": "https://example.com/hooks",
                                                                "events": ["interrupt.waiting"]})).json()
        runs = []
        for _ in range(2):  # the same request twice: one turn, one event
            r = await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "native"},
                             headers={"Idempotency-Key": "approve-1"})
            assert r.json()["status"] == "waiting"
        runs.append(r.json()["run_id"])
        chat = {"model": "echo", "user": "openai", "messages": [{"role": "user", "content": "approve"}]}
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.json()["moorage"]["status"] == "waiting"
        runs.append(r.json()["moorage"]["run_id"])
        r = await c.post("/v1/chat/completions", json={**chat, "user": "streamed", "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text
    async with mcp_client(f"{live_rt.url}/mcp/echo", acme) as client:
        waiting = await client.call_tool("send_message", {"message": "approve", "user": "mcp"})
        assert waiting.structured_content["status"] == "waiting"
        runs.append(waiting.structured_content["run_id"])
    async with aclient(live_rt, acme) as c:
        events = [d["payload"] for d in
                  (await c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries")).json()["data"]]
    assert sorted(e["data"]["user"] for e in events) == ["mcp", "native", "openai", "streamed"]
    for e in events:
        assert e["type"] == "interrupt.waiting" and set(e["data"]) == FIELDS
        assert e["data"]["interrupt"] == {"question": "ship it?", "draft": "draft-1"} and e["data"]["trace_id"]
    assert set(runs) <= {e["data"]["run_id"] for e in events}
