"""``[agent.retention]`` in an agent's moorage.toml: validated at deploy with a clear error, and applied to
the agent's data (the sweeper deletes this agent's idle turns' events, not another agent's)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moorage.errors import InvalidInput
from moorage.runtime.package import AgentPackageError
from moorage.store import Scope
from moorage.store.model import EntityKey
from tests.runtime.conftest import Env, write_agent

ECHO = """
async def on_message(ctx, message):
    return "echo: " + message
"""


async def test_bad_retention_table_fails_the_deploy(env: Env, tmp_path: Path) -> None:
    for table in ("[agent.retention]\nttl_s = 0\n", "[agent.retention]\nttl_s = \"1d\"\n",
                  "[agent.retention]\nttl_s = true\n", "[agent.retention]\nevents_ttl_s = 60\n",
                  "retention = 60\n"):
        src = write_agent(tmp_path / "bad", "bad", ECHO, table)
        with pytest.raises(AgentPackageError) as e:
            await env.runtime.deploy(env.principal, src)
        assert isinstance(e.value, InvalidInput) and "[agent.retention]" in e.value.message, (table, e.value.message)
        assert e.value.hint and "ttl_s" in e.value.hint


@pytest.mark.timeout(240)
async def test_deployed_retention_sweeps_that_agents_turns_only(env: Env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "brief", "brief", ECHO,
                                                        "[agent.retention]\nttl_s = 60\n"))
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "keeper", "keeper", ECHO))
    ts = env.store.tenant(env.principal)
    assert ts.retention.agents() == {"brief": 60.0}
    for agent in ("brief", "keeper"):
        r = await env.runtime.invoke(env.principal, EntityKey(agent, "ada", "s1"), "hello")
        assert r.reply == "echo: hello"
    assert ts.events.list(Scope.session("brief", "ada", "s1")) and ts.events.list(Scope.session("keeper", "ada", "s1"))
    assert env.store.operator.sweep_all(now=time.time() + 120).scopes >= 1
    assert ts.events.list(Scope.session("brief", "ada", "s1")) == []
    assert [e.content for e in ts.events.list(Scope.session("keeper", "ada", "s1"))][-1] == "echo: hello"


async def test_bad_keep_deployments_fails_the_deploy(env: Env, tmp_path: Path) -> None:
    for value in ("0", "-1", "2.5", "true", '"10"'):
        src = write_agent(tmp_path / "bad", "bad", ECHO, f"[agent.retention]\nkeep_deployments = {value}\n")
        with pytest.raises(AgentPackageError) as e:
            await env.runtime.deploy(env.principal, src)
        assert "keep_deployments must be a whole number of at least 1" in e.value.message, (value, e.value.message)
    assert env.store.tenant(env.principal).agents.list() == []  # refused before anything was recorded


async def test_keep_deployments_deletes_the_oldest_as_a_deploy_goes_live_and_leaves_the_rest_of_retention(
        env: Env, tmp_path: Path) -> None:
    """Each deploy that goes live keeps the agent's newest ``keep_deployments`` (the live one among them); the
    older ones are deleted with it, in its transaction. A table with only this setting leaves the agent's TTL as
    the API set it."""
    ts = env.store.tenant(env.principal)
    for n in (1, 2, 3, 4):
        src = write_agent(tmp_path / f"v{n}", "kept", ECHO.replace("echo:", f"v{n}:"),
                          "[agent.retention]\nkeep_deployments = 2\n")
        await env.runtime.deploy(env.principal, src)
        if n == 1:
            ts.retention.set_agent("kept", 3600)
    agent = ts.agents.get("kept")
    assert [d.number for d in ts.deployments.list(agent.id)] == [3, 4]
    assert [d.status for d in ts.deployments.list(agent.id, deleted=True)] == ["deleted", "deleted", "ready", "ready"]
    assert ts.retention.agents() == {"kept": 3600.0}
    r = await env.runtime.invoke(env.principal, EntityKey("kept", "ada", "s1"), "hi")
    assert r.reply == "v4: hi"
    assert (await env.runtime.rollback(env.principal, "kept")).number == 3


def test_the_same_folder_packs_to_the_same_bytes_whenever_it_is_packed(tmp_path: Path) -> None:
    """The package's digest is its identity (a redeploy of the same folder keeps nothing more): the gzip header's
    time is zero, not the time of packing (it was, and the same folder hashed anew every second)."""
    from moorage.runtime.package import load_dir

    src = write_agent(tmp_path / "same", "same", ECHO)
    first = load_dir(src)
    assert first.archive[4:8] == b"\0\0\0\0"  # RFC 1952: MTIME
    time.sleep(1.1)
    assert load_dir(src).sha256 == first.sha256
