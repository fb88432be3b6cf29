"""A key limited to one agent reads its agent's instances, usage and spans through the CLI: `moorage ps`, `moorage
usage` and `moorage logs` take `--agent`, and without it the one-line error says to pass it (the API's hint, which
says to add agent= to the query, was one a CLI user could not act on)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401  (fixtures)

GZ = {"content-type": "application/gzip"}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


async def test_a_key_for_one_agent_names_it_with_the_agent_option(live_rt, acme: str, tmp_path: Path) -> None:  # noqa: F811
    async with aclient(live_rt, acme) as admin:
        for agent, user in (("echo", "ada"), ("other", "bea")):
            r = await admin.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
            assert r.status_code == 201, r.text
            assert (await admin.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": user})).status_code == 200
        key = (await admin.post("/v1/keys", json={"scopes": ["read"], "agent": "echo"})).json()["secret"]

    def run(secret: str, *args: str) -> Any:
        env = {"MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": secret, "MOORAGE_DATA_DIR": str(tmp_path / "cli")}
        return CliRunner().invoke(app, list(args), env=env)

    for command, what in (("ps", "fleet"), ("usage", "usage"), ("logs", "spans")):
        for extra in ([], ["--agent", "other"]):
            r = await asyncio.to_thread(run, key, command, *extra)
            assert r.exit_code == 2 and r.stdout == "", (command, extra, r.exit_code, r.stdout, r.stderr)
            # (the server runs in this process: its log lines land on the same stderr)
            assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
                f"error: 403: this key is limited to agent 'echo'; it may read that agent's {what} only "
                "(pass `--agent echo`, or use a key that is not limited to one agent)"], (command, r.stderr)

    r = await asyncio.to_thread(run, key, "ps", "--agent", "echo", "--json")
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout)
    assert [(i["agent_id"], i["scope"]) for i in listed["data"]] == [("echo", "user:echo/ada")], listed
    assert sum(listed["counts"].values()) == 1, listed
    r = await asyncio.to_thread(run, key, "ps", "--agent", "echo")  # the table too
    # (the other agent's instance by its scope: a random sandbox id may hold the letters "bea")
    assert r.exit_code == 0 and "echo/ada" in r.stdout and "other/bea" not in r.stdout, r.output
    r = await asyncio.to_thread(run, key, "usage", "--agent", "echo", "--json")
    assert r.exit_code == 0 and "totals" in json.loads(r.stdout), r.output
    r = await asyncio.to_thread(run, key, "logs", "--agent", "echo", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["data"], r.stdout

    # A key of the whole tenant reads every agent's, or one agent's when it names one.
    r = await asyncio.to_thread(run, acme, "ps", "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["data"]) == 2, r.output
    r = await asyncio.to_thread(run, acme, "ps", "--agent", "other", "--json")
    assert r.exit_code == 0, r.output
    assert [i["agent_id"] for i in json.loads(r.stdout)["data"]] == ["other"], r.stdout
