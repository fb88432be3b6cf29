"""Every command that talks to the server fails the same way however it is run: one line on stderr, nothing on
stdout, exit status 2. The commands without a decorator of their own used to get that line only from the installed
`moorage` (its entry point); run through Typer (its test runner, an embedding program) they exited 1 in silence."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from moorage.cli.main import app
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import LiveServer, live  # noqa: F401  (fixtures)
from tests.cli.test_cli_json import commands

#: The commands that talk to the server, with what each needs beside its required arguments (given as "x").
SERVER: dict[str, list[str]] = {
    "agents": [], "agents delete": ["--yes"], "answer": [], "chat": ["--user", "x"], "checkpoint": [], "checkpoints fork": ["--to", "y"],
    "checkpoints list": [], "checkpoints rollback": [], "checkpoints take": [], "deploy": [], "execution": [],
    "deployments list": [], "deployments delete": [],
    "forget": ["--yes"], "fork": ["--to", "y"], "invoke": ["--user", "x"], "logs": [], "memory confirm": [],
    "memory pending": [], "memory reject": [], "ps": [], "rollback": [], "secrets list": [], "secrets rm": [],
    "secrets set": [], "share": [], "sleep": [], "submit": ["--user", "x"], "trace": [], "usage": [], "user": [],
    "users": [], "wake": [],
}
#: The commands that work on this machine (its store, its files, its images) or serve.
LOCAL = {
    "backup", "bench", "cost prices", "cost simulate", "cost trace generate", "cost trace scenarios", "doctor",
    "host", "host drain", "hosts", "hosts drain", "image build", "image list", "image prune", "llm chat",
    "llm providers", "memory eval", "memory eval generate", "memory facts", "memory search", "secrets rotate-key",
    "store create-tenant", "store delete-tenant", "store info", "store migrate", "store sweep", "store tenant-limits", "store tenants", "up",
    "version",
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


def test_every_command_is_classified() -> None:
    assert set(commands()) == set(SERVER) | LOCAL, (set(commands()) - set(SERVER) - LOCAL,
                                                    (set(SERVER) | LOCAL) - set(commands()))


def test_every_server_command_says_the_servers_refusal_in_one_line(live: LiveServer, tmp_path: Path) -> None:  # noqa: F811
    folder = tmp_path / "agent"  # for `deploy`: an agent that passes the local checks, so the server is asked
    folder.mkdir()
    (folder / "moorage.toml").write_text('[agent]\nname = "x"\nentry = "agent.py"\n')
    (folder / "agent.py").write_text("def on_message(ctx, message):\n    return message\n")
    # A key the server does not know: every request is refused at once (401), whatever the command asks.
    env = {"MOORAGE_API_URL": live.url, "MOORAGE_API_KEY": "mk_nobody", "MOORAGE_DATA_DIR": str(tmp_path / "data")}
    found = commands()
    for words, extra in SERVER.items():
        args = [str(folder) if words == "deploy" else "1" if p.name == "number" else "x"
                for p in found[words].params if p.required and p.param_type_name == "argument"]
        r = CliRunner().invoke(app, [*words.split(), *args, *extra], env=env, input="value\n")
        assert r.exit_code == 2 and r.stdout == "", (words, r.exit_code, r.stdout, r.stderr, r.exception)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: 401: "), (words, r.stderr)
