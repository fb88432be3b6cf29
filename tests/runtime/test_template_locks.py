"""The per-deployment single-flight lock of a host's templates lives only while something holds or waits on it: a
host up for months, through thousands of deploys, kept one lock for every deployment it ever built."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.runtime.conftest import write_agent

V1 = '''
async def on_message(ctx, message):
    return "v1"
'''


async def test_no_lock_is_kept_per_deployment_built_and_waiters_share_one(env, tmp_path: Path) -> None:  # noqa: ANN001
    tpl = env.runtime.templates
    root = write_agent(tmp_path / "agent", "counter", V1)
    deployed = []
    for n in range(3):
        (root / "agent.py").write_text(V1.replace('"v1"', f'"v{n + 1}"'))
        deployed.append(await env.runtime.deploy(env.principal, root))
        assert tpl._locks == {} and tpl._lock_users == {}  # built, and its lock gone with it
    d = deployed[-1]
    async with tpl._deployment_lock(d.id):  # held (a build in progress): an ensure of it waits on the same lock
        waiting = asyncio.create_task(tpl.ensure(d))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert list(tpl._locks) == [d.id] and tpl._lock_users == {d.id: 2}
    ref = await waiting
    assert ref.id == tpl.cached(d.id).id
    assert tpl._locks == {} and tpl._lock_users == {}
