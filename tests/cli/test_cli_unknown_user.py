"""The CLI's listings of one end-user's things through the server (`moorage memory pending`, `moorage checkpoints
list`, `moorage share --list`, `moorage secrets list --user`) fail with one line for a user the agent does not have,
naming the command that lists its users (exit 2, nothing on stdout). They printed an empty list and exited 0, which
reads as "this user has none". A user it has, with nothing yet, still gets an empty list."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from moorage import AsyncClient
from moorage.cli.main import app
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import acme, agent_archive, globex, live_rt, runtime  # noqa: F401  (fixtures)

LISTINGS = {  # each listing of USER's things of agent "web"
    "memory pending": lambda user: ["memory", "pending", "web", user],
    "checkpoints list": lambda user: ["checkpoints", "list", "web", user],
    "share --list": lambda user: ["share", "web", user, "--list"],
    "secrets list": lambda user: ["secrets", "list", "web", "--user", user],
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


async def test_listings_of_an_unknown_user_fail_in_one_line(live_rt, acme: str, globex: str,  # noqa: F811
                                                            tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, globex) as sdk:  # another tenant's ada
        await sdk.deploy("web", agent_archive(tmp_path, "web"))
        await sdk.invoke("web", "hi", user="ada")
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("web", agent_archive(tmp_path, "web"))
        await sdk.put_user("web", "bea")

    def run(key: str, args: list[str]) -> Any:
        env = {"MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": key, "MOORAGE_DATA_DIR": str(tmp_path / "cli")}
        return CliRunner().invoke(app, args, env=env)

    for name, args in LISTINGS.items():
        for json_flag in ([], ["--json"]):
            r = await asyncio.to_thread(run, acme, [*args("ada"), *json_flag])
            assert r.exit_code == 2 and r.stdout == "", (name, r.exit_code, r.stdout, r.stderr)
            # (the server runs in this process: its log lines land on the same stderr)
            assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
                "error: 404: agent 'web' has no user 'ada' (check the user id; `moorage users web` lists them)"], \
                (name, r.stderr)
        r = await asyncio.to_thread(run, acme, [*args("bea"), "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["data"] == [], (name, r.output)
        r = await asyncio.to_thread(run, globex, [*args("ada"), "--json"])  # where ada is one of web's users
        assert r.exit_code == 0, (name, r.output)
