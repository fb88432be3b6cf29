"""``moorage memory pending`` / ``confirm`` / ``reject`` run in-process against a real server over the real runtime
(process sandboxes, SQLite), as docs/memory.md shows them: what an agent learned is listed, decided, and the
decision shows in the user's facts; errors read as one line, never a traceback; another tenant's key reaches
nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import Result
from typer.testing import CliRunner

from moorage import AsyncClient
from moorage.cli.main import app
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import acme, agent_archive, globex, live_rt, runtime  # noqa: F401  (fixtures)

LEARNS = '''
async def on_message(ctx, message):
    _, attribute, value = message.split(" ", 2)
    r = await ctx.memory.learn("user", attribute, value, f"the user's {attribute} is {value}")
    return r["status"]
'''


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


async def moorage(live: Any, key: str, *args: str) -> Result:
    env = {"MOORAGE_API_URL": live.url, "MOORAGE_API_KEY": key, "MOORAGE_DATA_DIR": str(live.data_dir)}
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def said(r: Result) -> str:
    return " ".join(r.output.split())


async def test_pending_facts_are_listed_confirmed_and_rejected_from_the_cli(live_rt, acme, globex) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("pal", agent_archive(live_rt.data_dir.parent, "pal", LEARNS))
        await sdk.add_fact("pal", "ada", "user", "city", "Lisbon")  # what she said herself
        await sdk.put_user("pal", "bo")  # a user with nothing pending
        for message in ("learn city Porto", "learn likes jazz", "learn pet [bold]Miso[/bold]"):
            assert (await sdk.invoke("pal", message, user="ada"))["reply"] == "pending"

    listed = await moorage(live_rt, acme, "memory", "pending", "pal", "ada", "--json")
    assert listed.exit_code == 0, listed.output
    facts = {f["value"]: f for f in json.loads(listed.stdout)["data"]}
    assert list(facts) == ["Porto", "jazz", "[bold]Miso[/bold]"]  # oldest first
    table = await moorage(live_rt, acme, "memory", "pending", "pal", "ada")
    assert table.exit_code == 0, table.output
    # Ids whole (the next command takes them), values as written (not console markup).
    assert all(f["id"] in table.stdout for f in facts.values()) and "[bold]Miso[/bold]" in table.stdout, table.stdout

    done = await moorage(live_rt, acme, "memory", "confirm", "pal", "ada", facts["Porto"]["id"])
    assert done.exit_code == 0, done.output
    assert said(done) == f"confirmed {facts['Porto']['id']}: user city = Porto (was Lisbon)"
    gone = await moorage(live_rt, acme, "memory", "reject", "pal", "ada", facts["jazz"]["id"], "--json")
    assert gone.exit_code == 0 and json.loads(gone.stdout)["fact"]["status"] == "rejected", gone.output
    async with AsyncClient(live_rt.url, acme) as sdk:
        assert [f["value"] for f in (await sdk.list_facts("pal", "ada", attribute="city"))["data"]] == ["Porto"]
        assert [f["value"] for f in (await sdk.list_pending_facts("pal", "ada"))["data"]] == ["[bold]Miso[/bold]"]

    # Deciding again, or a fact that is not there: the server's reason in one line, exit status 2.
    twice = await moorage(live_rt, acme, "memory", "reject", "pal", "ada", facts["Porto"]["id"])
    assert twice.exit_code == 2 and "not pending" in said(twice) and "Traceback" not in twice.output, twice.output
    missing = await moorage(live_rt, acme, "memory", "confirm", "pal", "ada", "no-such-fact")
    assert missing.exit_code == 2 and "404" in said(missing) and "Traceback" not in missing.output, missing.output
    nothing = await moorage(live_rt, acme, "memory", "pending", "pal", "bo")
    assert nothing.exit_code == 0 and said(nothing) == "no facts of user bo of pal wait for confirmation"

    # Another tenant's key: neither listed nor decided, and nothing of ada's shown.
    miso = facts["[bold]Miso[/bold]"]["id"]
    for args in (("pending", "pal", "ada"), ("confirm", "pal", "ada", miso), ("reject", "pal", "ada", miso)):
        r = await moorage(live_rt, globex, "memory", *args)
        assert r.exit_code == 2 and "404" in said(r) and "Miso" not in r.output, r.output
    async with AsyncClient(live_rt.url, acme) as sdk:
        assert [f["id"] for f in (await sdk.list_pending_facts("pal", "ada"))["data"]] == [miso]
