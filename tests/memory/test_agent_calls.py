"""ctx.memory as agent code uses it, through a real runtime and server: what a bad argument gets back."""

from __future__ import annotations

import json
from pathlib import Path

from moorage import AsyncClient
from moorage.store import Scope, Store
from tests.api.conftest import agent_archive

AGENT = '''
import json

async def on_message(ctx, message):
    out = []
    for op, kw in json.loads(message):
        try:
            out.append(await getattr(ctx.memory, op)(**kw))
        except ctx.HostError as e:
            out.append({"kind": e.kind, "error": str(e)})
        except Exception as e:
            out.append({"kind": None, "error": type(e).__name__ + ": " + str(e)})
    return json.dumps(out)
'''


async def test_learn_and_recall_refuse_arguments_of_the_wrong_type(live_rt, store: Store, acme: str,
                                                                   tmp_path: Path) -> None:
    calls = [
        ["learn", {"subject": "user", "attribute": "city", "value": None, "text": "no value"}],
        ["learn", {"subject": "user", "attribute": ["city"], "value": "Lisbon", "text": "a list"}],
        ["learn", {"subject": "user", "attribute": "city", "value": 7, "text": None}],
        ["recall", {"query": "city", "k": "many"}],
        ["recall", {"query": "city", "k": 0}],
        ["facts", {"subject": ["user"]}],
        ["context", {"message": "hi", "tools": "get_weather"}],
        ["context", {"message": "hi", "system": ["Be brief."]}],
        ["context", {"message": None}],
    ]
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("mem", agent_archive(tmp_path, "mem", AGENT))
        reply = json.loads((await sdk.invoke("mem", json.dumps(calls), user="ada"))["reply"])
    for call, got in zip(calls, reply):
        assert isinstance(got, dict) and got.get("kind") == "invalid-input", (call, got)
    ts = store.tenant(store.authenticate(acme))
    facts = ts.facts.list(Scope.for_user("mem", "ada"), include_closed=True, statuses=("active", "pending"))
    assert [f.value for f in facts if f.attribute == "city"] == []
