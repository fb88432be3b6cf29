"""A search hit has one shape on both sides: what the agent's ``ctx.memory.recall`` returns in a turn and what the
API's search (``sdk.search_events``) answers for the same user and query have the same keys and the same values."""

from __future__ import annotations

import json
from pathlib import Path

from moorage import AsyncClient
from tests.api.conftest import agent_archive

AGENT = '''
import json

async def on_message(ctx, message):
    if message.startswith("note "):
        return str(await ctx.memory.remember(message[len("note "):]))
    return json.dumps(await ctx.memory.recall(message, k=3))
'''
KEYS = {"id", "text", "speaker", "ts", "kind", "scope", "meta", "score", "event"}


async def test_recall_in_the_agent_and_search_through_the_api_answer_the_same_hits(live_rt, acme: str,
                                                                                    tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("keeper", agent_archive(tmp_path, "keeper", AGENT))
        noted = [int((await sdk.invoke("keeper", f"note {text}", user="ada"))["reply"])
                 for text in ("I prefer aisle seats", "my cat is called Heron")]
        recalled = json.loads((await sdk.invoke("keeper", "aisle seats", user="ada"))["reply"])
        searched = (await sdk.search_events("keeper", "ada", "aisle seats", k=3))["data"]
        listed = {e["id"]: e for e in (await sdk.list_events("keeper", "ada"))["data"]}

    assert recalled and searched
    assert all(set(h) == KEYS for h in recalled + searched), (recalled, searched)
    agent_side = {h["id"]: h for h in recalled}
    api_side = {h["id"]: h for h in searched}
    assert noted[0] in agent_side and noted[0] in api_side
    for event_id in set(agent_side) & set(api_side):
        a, b = dict(agent_side[event_id]), dict(api_side[event_id])
        a.pop("score"), b.pop("score")  # each search ranks at its own moment
        assert a == b
        assert a["text"] == a["event"]["content"] and a["event"] == listed[event_id]

