"""A checkpoint name is one line of printable text: one holding a newline, a tab, an escape sequence, another
control character, a line separator or a bidirectional override is refused (422 invalid-input, naming the
character, with a hint) from the API, the sandbox verbs, the SDK, the CLI and ``ctx.checkpoint``, before anything
is taken. Before, such names were recorded and broke the listing's lines (the CLI's table, logs). Emoji sequences
(with their zero-width joiners) and other Unicode stay accepted."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moorage import AsyncClient
from moorage.client.errors import BadRequest
from moorage.store import Store
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import AGENT, tt_archive

BASE = "/v1/agents/tt/users/ada/checkpoints"
ROOT = Path(__file__).resolve().parents[2]
#: A name, and the character the refusal names.
BAD = {"two\nlines": "U+000A", "tab\there": "U+0009", "\x1b[31mred": "U+001B", "bell\x07": "U+0007",
       "del\x7f": "U+007F", "line\u2028sep": "U+2028", "\u202egnp.exe": "U+202E", "cr\r": "U+000D"}
MARKING = AGENT.replace('    if message == "ls":', '''    if message.startswith("mark "):
        try:
            ck = await ctx.checkpoint(json.loads(message[len("mark "):]))
            return "took " + ck["name"]
        except Exception as e:
            return "refused: " + str(e)
    if message == "ls":''')


async def test_a_name_with_control_characters_is_refused_everywhere(live_rt, store: Store, acme: str,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path, body=MARKING),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "ada"})).status_code == 200
        sid = store.tenant(store.authenticate(acme)).sandboxes.list()[0].id
        before = (await c.get(BASE)).json()["data"]

        for bad, char in BAD.items():
            for r in [await c.post(BASE, json={"name": bad}),
                      await c.post(f"/v1/sandboxes/{sid}/checkpoint", json={"label": bad}),
                      await c.post(f"/v1/sandboxes/{sid}/fork", json={"label": bad, "to_users": ["bea"]})]:
                assert r.status_code == 422, r.text
                body = r.json()
                assert body["type"].endswith("/invalid-input"), body
                assert "one line of printable text" in body["detail"] and char in body["detail"], body
                assert "without newlines, tabs or other control characters" in body["hint"], body
            r = await c.post("/v1/agents/tt/invoke", json={"message": "mark " + json.dumps(bad), "user": "ada"})
            assert r.status_code == 200, r.text
            assert r.json()["reply"].startswith("refused: ") and "one line of printable text" in r.json()["reply"]
        now = (await c.get(BASE)).json()["data"]
        assert now[len(now) - len(before):] == before
        assert {(ck["kind"], ck["name"]) for ck in now[:len(now) - len(before)]} == {("turn", None)}  # the turns' own
        assert (await c.get("/v1/agents/tt/users/bea")).status_code == 404

        for good in ("family 👨‍👩‍👧", "café au lait", "проверка ✓"):
            r = await c.post(BASE, json={"name": good})
            assert r.status_code == 201 and r.json()["name"] == good, r.text
        r = await c.post("/v1/agents/tt/invoke", json={"message": "mark " + json.dumps("from code 🚀"), "user": "ada"})
        assert r.json()["reply"] == "took from code 🚀"

    async with AsyncClient(live_rt.url, acme) as sdk:
        with pytest.raises(BadRequest) as e:
            await sdk.take_checkpoint("tt", "ada", name="a\nb")
        assert e.value.status == 422 and "U+000A (a newline)" in str(e.value)

    env = {**os.environ, "MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": acme,
           "MOORAGE_DATA_DIR": str(tmp_path / "cli"), "MOORAGE_LOG_LEVEL": "warning"}
    cli = await asyncio.to_thread(subprocess.run, [str(Path(sys.executable).parent / "moorage"), "checkpoints",
                                                   "take", "tt", "ada", "--name", "x\ty"],
                                  env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert cli.returncode != 0 and "U+0009" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
