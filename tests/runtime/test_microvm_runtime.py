"""The runtime on the micro-VM driver: deploy, a template snapshot, a user's VM forked from it, sleep and wake.

The same agent code as on the process driver; here it runs in its own kernel and sleeps with its memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.store import EntityKey, Scope
from tests.runtime.conftest import Env, make_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def vm_env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "microvm"):
        yield e


async def test_coder_in_a_micro_vm_keeps_its_package_and_files_across_sleep(vm_env: Env) -> None:
    env = vm_env
    assert env.runtime.driver.name == "microvm"
    await env.runtime.deploy(env.principal, EXAMPLES / "coder")
    k = EntityKey("coder", "dev", session="s1")
    assert (await env.runtime.invoke(env.principal, k, "install")).reply == "installed slugkit"
    assert (await env.runtime.invoke(env.principal, k, "write")).reply == "wrote projects/slug.py"
    ts = env.store.tenant(env.principal)
    scope = Scope.for_user("coder", "dev")
    assert await env.manager.sleep(ts, scope)
    assert ts.sandboxes.for_scope(scope).state == "sleeping"
    # The next turn wakes the VM from its snapshot; the package and files are where they were.
    r = await env.runtime.invoke(env.principal, EntityKey("coder", "dev", session="s2"), "run Micro VM works")
    assert r.reply == "micro-vm-works"
    # Another user gets their own VM, forked from the template: none of dev's files.
    other = await env.runtime.invoke(env.principal, EntityKey("coder", "eve"), "ls")
    assert "projects" not in other.reply
