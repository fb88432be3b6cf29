"""`moorage memory facts` and `moorage memory search` (operator commands, direct store access) refuse an agent or
a user the tenant does not have: one line saying so and where to look, exit 2, nothing on stdout. A mistyped
--agent or --user used to print an empty list and exit 0, which reads as "this user has no memory"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.config import Config
from moorage.memory.semantic import SemanticMemory
from moorage.store import Scope, open_store


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, str]:
    """A store whose tenant acme has agent concierge, with user alice (one fact) and user bob (a session only);
    returns the data directory and the agent's id."""
    store = open_store(Config(data_dir=tmp_path))
    t, _ = store.operator.create_tenant("acme")
    ts = store.tenant(store.operator.principal(t.id))
    agent = ts.agents.create("concierge")
    ts.agent_users.put("concierge", "alice")
    scope = Scope.for_user("concierge", "alice")
    SemanticMemory(ts).observe(scope, ts.events.append(scope, "message", "I live in Lisbon.", speaker="user"))
    ts.sessions.open("concierge", "bob", "s1")
    store.close()
    return tmp_path, agent.id


def cli(data: Path, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["--data-dir", str(data), "memory", *args])


COMMANDS = {"facts": [], "search": ["Lisbon"]}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_an_unknown_agent_is_an_error_not_an_empty_list(command: str, json_flag: list[str],
                                                        data: tuple[Path, str]) -> None:
    r = cli(data[0], command, *COMMANDS[command], "--tenant", "acme", "--agent", "concerge", "--user", "alice",
            *json_flag)
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: tenant 'acme' has no agent 'concerge' (check --agent; `moorage agents` "
                                     "lists them (with the tenant's API key))"], r.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_user_is_an_error_not_an_empty_list(command: str, data: tuple[Path, str]) -> None:
    r = cli(data[0], command, *COMMANDS[command], "--tenant", "acme", "--agent", "concierge", "--user", "alcie",
            "--json")
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["error: agent 'concierge' of tenant 'acme' has no user 'alcie' (check --user; "
                                     "`moorage users concierge` lists them (with the tenant's API key))"], r.stderr


def test_known_users_are_read_by_the_agents_name_or_id(data: tuple[Path, str]) -> None:
    path, agent_id = data
    for agent in ("concierge", agent_id):
        r = cli(path, "facts", "--tenant", "acme", "--agent", agent, "--user", "alice", "--json")
        assert r.exit_code == 0, r.output
        assert [(f["attribute"], f["value"]) for f in json.loads(r.stdout)["data"]] == [("lives_in", "Lisbon")]
    # A user with a session and nothing else (an agent that makes users as they come) is known: no facts yet.
    r = cli(path, "facts", "--tenant", "acme", "--agent", "concierge", "--user", "bob", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["data"] == [], r.output
    r = cli(path, "search", "Lisbon", "--tenant", "acme", "--agent", agent_id, "--user", "alice", "--json")
    assert r.exit_code == 0, r.output
    assert any("Lisbon" in h["event"]["content"] for h in json.loads(r.stdout)["data"]), r.stdout
