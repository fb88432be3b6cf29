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


LOOP = '''
async def on_message(ctx, message):
    for i in range(int(message)):
        ctx.files.write("blob.bin", str(i) * 100_000)  # each step changes a file: each checkpoint copies it
        await ctx.checkpoint("step")
    return "done"
'''


async def test_a_loop_of_agent_checkpoints_keeps_the_newest_named_and_the_apis_all(live_rt, runtime,  # noqa: F811
                                                                                    store: Store, acme: str,
                                                                                    tmp_path: Path) -> None:
    # The agent's code can checkpoint as often as it likes; retention keeps the newest `named` of those (their
    # sandbox copies too), so a loop of them cannot fill the host's disk. One named through the API stays.
    policy = "[agent.timetravel]\nauto = false\nkeep = 1\ndaily = 0\nnamed = 3\n"
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", headers={"content-type": "application/gzip"},
                         content=tt_archive(tmp_path, body=LOOP, manifest=policy))
        assert r.status_code == 201, r.text
        for message in ("0", "40"):  # the user's first turn, then a bookmark through the API, then the loop
            r = await c.post("/v1/agents/tt/invoke", json={"message": message, "user": "ada"})
            if message == "0":
                assert (await c.post(BASE, json={"name": "bookmark"})).status_code == 201
        assert r.status_code == 200 and r.json()["reply"] == "done", r.text
        listing = (await c.get(BASE)).json()["data"]
        steps = sorted(x["seq"] for x in listing if x["name"] == "step")
        assert max(steps) == 41 and "bookmark" in {x["name"] for x in listing}
        # Pruned at 10, 20, 30 and 40 to the newest three: what 41 added since.
        assert steps == [38, 39, 40, 41], steps
        sid = store.tenant(store.authenticate(acme)).sandboxes.list()[0].id
        on_disk = {h.name for h in await (await runtime.driver.open(sid)).checkpoints() if h.name.startswith("tt-")}
        assert on_disk == {x["sandbox_checkpoint"] for x in listing}  # the pruned ones' sandbox copies went too
