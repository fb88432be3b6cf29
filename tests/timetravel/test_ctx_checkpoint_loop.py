"""``ctx.checkpoint(name)`` called more than once with the same name in one turn (a loop of migration steps, each
checkpointed first) takes a checkpoint each time, so a rollback to the second lands before the second step; a turn
replayed after a crash that asks again gets, call by call, the ones it took."""

from __future__ import annotations

import json
import types
from pathlib import Path

from moorage.store import EntityKey, Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

BODY = '''
import json

async def on_message(ctx, message):
    if message == "steps":
        ids = []
        for i in range(3):
            ck = await ctx.checkpoint("before-step")
            ids.append(ck["id"])
            ctx.files.write(f"step{i}.txt", str(i))
        return json.dumps(ids)
    return json.dumps(sorted(n for n in ctx.files.list(".") if n.startswith("step")))
'''
BASE = "/v1/agents/tt/users/ada/checkpoints"


async def test_the_same_name_asked_for_again_in_a_turn_is_a_new_checkpoint(live_rt, runtime, store: Store,  # noqa: F811
                                                                          acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", headers={"content-type": "application/gzip"},
                         content=tt_archive(tmp_path, body=BODY, manifest="[agent.timetravel]\nauto = false\n"))
        assert r.status_code == 201, r.text

        async def ask(message: str) -> list[str]:
            r = await c.post("/v1/agents/tt/invoke", json={"message": message, "user": "ada"})
            assert r.status_code == 200, r.text
            return json.loads(r.json()["reply"])

        ids = await ask("steps")
        assert len(set(ids)) == 3, ids
        listing = (await c.get(BASE)).json()["data"]
        assert [x["id"] for x in listing] == ids[::-1] and {x["name"] for x in listing} == {"before-step"}
        turn_id = listing[0]["summary"]["during_turn"]

        r = await c.post(f"{BASE}/{ids[1]}/rollback", json={})
        assert r.status_code == 200, r.text
        assert await ask("ls") == ["step0.txt"]  # before the second step: the first one done

    # The same turn run again (a replay after a crash: a new execution of that turn id) asks three times again.
    ts = store.tenant(store.authenticate(acme))
    replay = types.SimpleNamespace(ts=ts, entity=EntityKey("tt", "ada"), turn_id=turn_id,
                                   manifest={"name": "tt", "timetravel": {"auto": False}})
    again = [(await runtime.timetravel.take_in_turn(replay, None, "before-step")).id for _ in range(3)]
    assert again == ids
