"""A redeploy reaches a user's running sandbox whole: the agent's own modules beside its entry (``import helper``)
are those of the new deployment, not the ones the old one imported into the same process, and a module the new
version no longer ships is gone."""

from __future__ import annotations

from pathlib import Path

from moorage.store import EntityKey
from tests.runtime.conftest import write_agent

AGENT = '''
import helper


async def on_message(ctx, message):
    if message == "gone?":
        try:
            import only_in_v1
            return "still there: " + only_in_v1.X
        except ImportError:
            return "gone"
    return helper.VALUE
'''


async def test_a_redeploy_replaces_the_agents_own_modules_in_a_running_sandbox(env, tmp_path: Path) -> None:
    rt = env.runtime
    v1 = write_agent(tmp_path / "v1", "mods", AGENT)
    (v1 / "helper.py").write_text("VALUE = 'v1'\n")
    (v1 / "only_in_v1.py").write_text("X = 'v1'\n")
    await rt.deploy(env.principal, v1)
    ann = EntityKey("mods", "ann")
    assert (await rt.invoke(env.principal, ann, "hi")).reply == "v1"
    # the old version imported it into the process: the new one must not find it
    assert (await rt.invoke(env.principal, ann, "gone?")).reply == "still there: v1"
    v2 = write_agent(tmp_path / "v2", "mods", AGENT)
    (v2 / "helper.py").write_text("VALUE = 'v2'\n")
    await rt.deploy(env.principal, v2)
    assert (await rt.invoke(env.principal, ann, "hi")).reply == "v2"
    assert (await rt.invoke(env.principal, ann, "gone?")).reply == "gone"
