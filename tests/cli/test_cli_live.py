"""CLI client commands run in-process against a real server over the real runtime (process sandboxes, SQLite).

Each command runs in a thread: the server and its runtime live on the test's event loop.
"""

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
from tests.api.conftest import acme, agent_archive, live_rt, runtime  # noqa: F401  (fixtures)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


async def moorage(live: Any, key: str, *args: str) -> Result:
    env = {"MOORAGE_API_URL": live.url, "MOORAGE_API_KEY": key, "MOORAGE_DATA_DIR": str(live.data_dir)}
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


async def test_checkpoints_rollback_and_fork_take_a_unique_name(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        await sdk.invoke("echo", "one", user="ann")
        first = await sdk.take_checkpoint("echo", "ann", name="before")
        await sdk.invoke("echo", "two", user="ann")
        twice = [(await sdk.take_checkpoint("echo", "ann", name="twice"))["id"] for _ in range(2)]

    back = await moorage(live_rt, acme, "checkpoints", "rollback", "echo", "ann", "before", "--json")
    assert back.exit_code == 0, back.output
    assert json.loads(back.stdout)["rolled_back_to"] == first["id"]

    forked = await moorage(live_rt, acme, "checkpoints", "fork", "echo", "ann", "before", "--to", "bob", "--json")
    assert forked.exit_code == 0, forked.output
    assert [f["user"] for f in json.loads(forked.stdout)["forks"]] == ["bob"]

    # A name two checkpoints share: refused, naming both ids; nothing rolled back.
    ambiguous = await moorage(live_rt, acme, "checkpoints", "rollback", "echo", "ann", "twice")
    said = " ".join(ambiguous.output.split())
    assert ambiguous.exit_code == 2 and "2 checkpoints" in said and all(i in said for i in twice), said
    assert "Traceback" not in said

    # Neither an id nor a name: the hint is the command that lists them, not an HTTP route.
    for cmd in (["rollback", "echo", "ann", "nothing-by-that-name"], ["fork", "echo", "ann", "nope", "--to", "cy"]):
        missing = await moorage(live_rt, acme, "checkpoints", *cmd)
        said = " ".join(missing.output.split())
        assert missing.exit_code == 2 and "moorage checkpoints list echo ann" in said and "/v1/" not in said, said


def app_archive(tmp: Path, name: str) -> bytes:
    """An agent that declares an app port (a share link needs one; nothing here opens the app)."""
    import io
    import tarfile

    root = tmp / f"app-src-{name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text("async def on_message(ctx, message):\n    return message\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


async def test_share_list_prints_utc_times_and_its_json_keeps_the_numbers(live_rt, acme) -> None:  # noqa: F811
    import time

    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("web", app_archive(live_rt.data_dir.parent, "web"))
        await sdk.put_user("web", "ada")
    made = await moorage(live_rt, acme, "share", "web", "ada", "--ttl", "1h", "--label", "review")
    assert made.exit_code == 0, made.output
    raw = await moorage(live_rt, acme, "share", "web", "ada", "--list", "--json")
    (link,) = json.loads(raw.stdout)["data"]
    assert isinstance(link["expires_at"], (int, float))
    shown = await moorage(live_rt, acme, "share", "web", "ada", "--list")
    assert shown.exit_code == 0, shown.output
    readable = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(link["expires_at"]))
    assert readable in shown.stdout and str(int(link["expires_at"])) not in shown.stdout, shown.stdout


async def test_submit_and_rollback_print_the_api_json(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        for version in ("", "2"):
            await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent, version=version))
    done = await moorage(live_rt, acme, "submit", "echo", "hi", "-u", "ann", "--wait", "--json")
    assert done.exit_code == 0, done.output
    ex = json.loads(done.stdout)
    assert (ex["status"], ex["reply"], ex["user"]) == ("succeeded", "echo2: hi", "ann") and ex["id"]
    queued = json.loads((await moorage(live_rt, acme, "submit", "echo", "again", "-u", "ann", "--json")).stdout)
    assert queued["id"] and queued["id"] != ex["id"]
    back = await moorage(live_rt, acme, "rollback", "echo", "--json")
    assert back.exit_code == 0, back.output
    assert json.loads(back.stdout)["number"] == 1


async def test_memory_search_finds_a_sessions_turn_messages_and_prints_json(live_rt, acme, tmp_path) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        await sdk.invoke("echo", "the heron nests by the weir", user="ann", session="s1")
    # Operator access: the store itself (the `store` fixture's files are <tmp_path>/store, as a data dir's are).
    env = {"MOORAGE_DATA_DIR": str(tmp_path)}
    args = ["memory", "search", "heron", "--tenant", "acme", "--agent", "echo", "--user", "ann"]
    found = await asyncio.to_thread(CliRunner().invoke, app, [*args, "--session", "s1", "--json"], env=env)
    assert found.exit_code == 0, found.output
    hits = json.loads(found.stdout)["data"]
    assert hits and all(h["event"]["scope"].endswith("s1") for h in hits), hits
    assert any("heron" in h["event"]["content"] for h in hits) and all("score" in h for h in hits)
    table = await asyncio.to_thread(CliRunner().invoke, app, [*args, "-s", "s1"], env=env)
    assert table.exit_code == 0 and "heron" in table.stdout, table.output


async def test_agents_lists_the_deployed_agents_with_their_live_deployment(live_rt, acme, store) -> None:  # noqa: F811
    none = await moorage(live_rt, acme, "agents")
    assert none.exit_code == 0 and "no agents yet" in none.stdout and "moorage deploy" in none.stdout, none.output
    async with AsyncClient(live_rt.url, acme) as sdk:
        for version in ("", "2"):
            await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent, version=version))
        await sdk.deploy("web", app_archive(live_rt.data_dir.parent, "web"))
        await sdk.rollback("echo", 1)
    listed = await moorage(live_rt, acme, "agents", "--json")
    assert listed.exit_code == 0, listed.output
    assert sorted(a["name"] for a in json.loads(listed.stdout)["data"]) == ["echo", "web"]
    table = await moorage(live_rt, acme, "agents")
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.stdout.splitlines() if line.startswith("│")]
    rows = {c[0]: c[1:3] for c in cells}
    assert rows == {"echo": ["#1", "2"], "web": ["#1", "1"]}, table.stdout
    # A delete cut short leaves the agent marked: the table says so (`moorage agents delete web` finishes it).
    store.tenant(store.authenticate(acme)).agents.mark_deleting("web")
    table = await moorage(live_rt, acme, "agents")
    assert "#1 (being deleted)" in table.stdout and "echo" in table.stdout, table.stdout


async def test_ps_lists_the_tenants_instances_from_the_fleet_route(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        await sdk.invoke("echo", "one", user="ann")
        box = (await sdk.fleet())["instances"][0]
    shown = await moorage(live_rt, acme, "ps")
    assert shown.exit_code == 0, shown.output
    assert box["id"] in shown.stdout and "running" in shown.stdout
    asleep = await moorage(live_rt, acme, "ps", "--state", "sleeping")
    assert asleep.exit_code == 0 and box["id"] not in asleep.stdout


async def test_logs_and_trace_show_when_how_long_and_readable_attributes(live_rt, acme) -> None:  # noqa: F811
    """`moorage logs` had no time and no duration, and its attributes were JSON cut at 80 characters (`"ht`), led by
    the tenant's id on every row. Now: when each span started (UTC), how long it took, and `key=value` pairs without
    the tenant, an ellipsis where they are cut; `--json` keeps them whole."""
    import re
    import time

    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        turn = await sdk.invoke("echo", "hello", user="ann")
    shown = await moorage(live_rt, acme, "logs", "--limit", "20")
    assert shown.exit_code == 0, shown.output
    out = shown.stdout
    assert time.strftime("%Y-%m-%d", time.gmtime()) in out and " UTC " in out, out
    assert "moorage.tenant" not in out and '{"' not in out and "http.status_code=200" in out, out
    whole = json.loads((await moorage(live_rt, acme, "logs", "--limit", "20", "--json")).stdout)["data"]
    assert any("moorage.tenant" in s["attrs"] for s in whole)  # left out of the table only
    row = next(line for line in out.splitlines() if "POST /v1/agents/{agent}/invoke" in line)
    assert re.search(r"│ \d+\.\d │ ok", row), row  # its duration in ms, then its status
    traced = await moorage(live_rt, acme, "trace", turn["trace_id"])
    assert traced.exit_code == 0 and "moorage.tenant" not in traced.stdout and '{"' not in traced.stdout, traced.stdout
