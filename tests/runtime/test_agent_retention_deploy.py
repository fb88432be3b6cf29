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
