"""A rollback or fork to a checkpoint that retention prunes while the request waits for a running turn of the same
user (the turn's automatic checkpoint is a tenth one, which prunes): answered 404 as for any checkpoint the user
does not have, and nothing changes. Before, the request went on with the checkpoint it had read before waiting:
a 409 saying its sandbox half "was never written", or, when the half was deleted a moment later, the sandbox
rolled back and the store not (the rest of the instance's history left unreachable by a dangling intent)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import AGENT, tt_archive

SLOW = AGENT.replace('    if message == "ls":', '''    if message.startswith("slow "):
        import asyncio
        await asyncio.sleep(float(message.split()[1]))
        return "slept"
    if message == "ls":''')
POLICY = "[agent.timetravel]\nauto = true\nkeep = 2\ndaily = 0\n"
BASE = "/v1/agents/tt/users/ada/checkpoints"


async def test_a_checkpoint_pruned_while_the_request_waited_is_a_404_and_nothing_changes(live_rt, acme: str,  # noqa: F811
                                                                                       tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, body=SLOW, manifest=POLICY),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text

        async def ask(message: str) -> str:
            r = await c.post("/v1/agents/tt/invoke", json={"message": message, "user": "ada"})
            assert r.status_code == 200, r.text
            return r.json()["reply"]

        assert (await c.put("/v1/agents/tt/users/ada")).status_code in (200, 201)  # listed before their 1st turn
        for verb, body in (("rollback", {}), ("fork", {"to_user": "bea"})):
            seq = max([x["seq"] for x in (await c.get(BASE)).json()["data"]], default=0)
            while seq % 10 != 8:
                seq += 1
                await ask(f"turn {seq}")
            files = json.loads(await ask("ls"))  # checkpoint 9 of ten: the next one's retention prunes the oldest
            listing = (await c.get(BASE)).json()["data"]
            assert listing[0]["seq"] % 10 == 9, [x["seq"] for x in listing]
            oldest = listing[-1]["id"]
            left_before = {x["id"] for x in listing if x["kind"] == "before-rollback"}
            slow = asyncio.create_task(ask("slow 1"))
            await asyncio.sleep(0.3)
            r = await c.post(f"{BASE}/{oldest}/{verb}", json=body)  # found, then waits for the turn
            assert await slow == "slept"
            assert r.status_code == 404, (verb, r.text)
            assert oldest in r.json()["detail"]
            assert json.loads(await ask("ls")) == files  # files and store where they were
            after = (await c.get(BASE)).json()
            assert {x["id"] for x in after["data"] if x["kind"] == "before-rollback"} <= left_before
            assert (await c.get("/v1/agents/tt/users/bea")).status_code == 404
            # The instance's time travel still works: a rollback to a kept checkpoint.
            kept = after["data"][1]["id"]
            r = await c.post(f"{BASE}/{kept}/rollback", json={})
            assert r.status_code == 200, r.text
