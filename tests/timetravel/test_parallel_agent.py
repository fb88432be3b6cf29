"""An agent whose turns run side by side (`concurrency = "parallel"`): a rollback or fork waits for the turns
running on the instance and the turns arriving meanwhile wait for it. Before, it ran under them: the process
driver's agent process restarted mid-turn (its caller got a 502 'sandbox-channel-closed') and the abandoned
branch's tip held half a turn."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import textwrap
from pathlib import Path

from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import AGENT

SLOW = AGENT.replace('    if message == "ls":', '''    if message.startswith("slow "):
        import asyncio
        ctx.files.write("notes/slow-a.txt", "begun")
        await asyncio.sleep(float(message.split()[1]))
        ctx.files.write("notes/slow-b.txt", "ended")
        return "slept"
    if message == "ls":''')
BASE = "/v1/agents/tt/users/ada/checkpoints"


def _archive(tmp_path: Path) -> bytes:
    root = tmp_path / "agent-src"
    root.mkdir()
    (root / "moorage.toml").write_text('[agent]\nname = "tt"\nentry = "agent.py"\n[agent.timetravel]\nauto = true\n'
                                       '[agent.lifecycle]\nusers = "auto"\nconcurrency = "parallel"\n')
    (root / "agent.py").write_text(textwrap.dedent(SLOW))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


async def test_rollback_and_fork_wait_for_the_turns_running_side_by_side(live_rt, acme: str,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text

        async def ask(message: str, session: str = "main") -> tuple[int, str]:
            r = await c.post("/v1/agents/tt/invoke", json={"message": message, "user": "ada", "session": session})
            return r.status_code, r.json().get("reply", r.text)

        assert await ask("turn 1") == (200, "done 1 step=10 files=1")
        assert await ask("turn 2") == (200, "done 2 step=20 files=2")
        one = (await c.get(BASE)).json()["data"][-1]["id"]

        slow = asyncio.create_task(ask("slow 1", "side"))
        await asyncio.sleep(0.4)  # the slow turn is running
        rollback = asyncio.create_task(c.post(f"{BASE}/{one}/rollback", json={}))
        await asyncio.sleep(0.2)
        meanwhile = asyncio.create_task(ask("ls", "third"))  # arrives while the rollback waits: runs after it
        assert await slow == (200, "slept")
        r = await rollback
        assert r.status_code == 200, r.text
        assert json.loads((await meanwhile)[1]) == {"1.txt": "note 1 for ada"}
        tip = r.json()["abandoned"]["tip"]

        # The abandoned branch's tip holds the slow turn whole.
        r = await c.post(f"{BASE}/{tip}/fork", json={"to_user": "bea"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/agents/tt/invoke", json={"message": "ls", "user": "bea"})
        assert sorted(json.loads(r.json()["reply"])) == ["1.txt", "2.txt", "slow-a.txt", "slow-b.txt"]

        # A fork waits the same way.
        slow = asyncio.create_task(ask("slow 1", "side"))
        await asyncio.sleep(0.4)
        r = await c.post(f"{BASE}/{tip}/fork", json={"to_user": "cy"})
        assert r.status_code == 201, r.text
        assert await slow == (200, "slept")
