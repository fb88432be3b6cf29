"""A misspelt or misplaced setting in an agent's moorage.toml fails its deploy with the setting named, instead of
being ignored (a typo'd size, egress rule or time-travel switch) or failing every turn afterwards ([agent.limits])."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.runtime.package import AgentPackageError
from moorage.store.model import EntityKey
from tests.runtime.conftest import Env, write_agent

ECHO = """
async def on_message(ctx, message):
    return "echo: " + message
"""

BAD = [
    ("memory_mb = 512\n", "unknown [agent] setting 'memory_mb'"),
    ("[agent.limits]\ncompute_secs = 1\n", "[agent.limits]: unknown limit 'compute_secs'"),
    ("[agent.egress]\nalow = [\"https://api.github.com\"]\n", "unknown [agent.egress] setting 'alow'"),
    ("[agent.network]\npackage = true\n", "unknown [agent.network] setting 'package'"),
    ("[agent.timetravel]\nautomatic = false\n", "unknown [agent.timetravel] setting 'automatic'"),
    ("[agent.timetravel]\nauto = \"no\"\n", "[agent.timetravel] auto must be true or false"),
    ("[agent.timetravel]\nkeep = 0\n", "[agent.timetravel] keep must be a whole number of at least 1"),
    ("[agent.timetravel]\nnamed = -1\n", "[agent.timetravel] named must be a whole number of at least 0"),
    ("[agent.mcp.docs]\nurl = \"https://docs.example.com/mcp\"\nheaders = { Authorization = \"x\" }\n",
     "[agent.mcp.docs] must have only url"),
]


async def test_a_wrong_setting_fails_the_deploy_naming_it(env: Env, tmp_path: Path) -> None:
    for i, (table, said) in enumerate(BAD):
        src = write_agent(tmp_path / f"bad{i}", "bad", ECHO, table)
        with pytest.raises(AgentPackageError) as e:
            await env.runtime.deploy(env.principal, src)
        assert said in e.value.message, (table, e.value.message)
        assert e.value.hint, (table, e.value.hint)  # says what to write instead
    ts = env.store.tenant(env.principal)
    assert [a.name for a in ts.agents.list()] == []  # none of them was deployed


async def test_the_right_settings_deploy_and_serve(env: Env, tmp_path: Path) -> None:
    good = ("memory_mib = 256\n[agent.limits]\ncompute_seconds_per_day = 3600\n"
            "[agent.egress]\nallow = [\"https://api.github.com\"]\n"
            "[agent.timetravel]\nauto = true\nkeep = 5\ndaily = 0\n"
            "[agent.mcp.docs]\nurl = \"https://docs.example.com/mcp\"\n")
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "good", "good", ECHO, good))
    r = await env.runtime.invoke(env.principal, EntityKey("good", "ada", "s1"), "hi")
    assert r.reply == "echo: hi"
