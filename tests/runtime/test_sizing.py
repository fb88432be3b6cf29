"""Sizing on the micro-VM driver: an agent's ``memory_mib`` and ``vcpus`` are its VM's (and every fork's), and
sizes this host cannot give fail the deploy with what to use instead, before anything boots or goes live."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio

from moorage.cpus import usable_cpus
from moorage.errors import InvalidInput
from moorage.runtime.package import AgentPackageError
from moorage.runtime.sizing import AgentSizingError, host_memory_mib
from moorage.store import EntityKey
from tests.runtime.conftest import Env, make_env, write_agent

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The agent reports what its kernel sees: MemTotal (KiB) and the CPUs it may run on.
SIZE_AGENT = """
import os

async def on_message(ctx, message):
    total = next(l for l in open("/proc/meminfo") if l.startswith("MemTotal:")).split()[1]
    return f"{int(total) // 1024} {len(os.sched_getaffinity(0))}"
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vm_env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path_factory.mktemp("sizing"), "microvm"):
        yield e


async def test_memory_and_vcpus_reach_the_vm_and_its_forks(vm_env: Env, tmp_path: Path) -> None:
    env = vm_env
    vcpus = min(2, usable_cpus())
    src = write_agent(tmp_path / "big", "big", SIZE_AGENT, f"memory_mib = 384\nvcpus = {vcpus}\n")
    await env.runtime.deploy(env.principal, src)
    seen = []
    for user in ("ada", "bob"):  # two users: two forks of the one template
        mem, cpus = map(int, (await env.runtime.invoke(env.principal, EntityKey("big", user), "size")).reply.split())
        seen.append((mem, cpus))
        # The kernel keeps some memory for itself: MemTotal sits a little under what the VM was given, and well
        # above the 256 MiB every VM had before.
        assert 256 < mem <= 384, mem
        assert cpus == vcpus
    ts = env.store.tenant(env.principal)
    assert len({r.id for r in ts.sandboxes.list() if r.scope.agent == "big"}) == 2


@pytest.mark.parametrize("line, words", [
    (f"memory_mib = {host_memory_mib() + 1024}", ["memory_mib", "MiB of memory", "memory_mib <="]),
    (f"vcpus = {usable_cpus() + 1}", ["vcpus", f"{usable_cpus()} CPUs", f"vcpus <= {usable_cpus()}"]),
    ("disk_mib = 16000000", ["disk_mib", "MiB free", "disk_mib <="]),
])
async def test_sizes_the_host_cannot_give_fail_the_deploy(vm_env: Env, tmp_path: Path, line: str,
                                                          words: list[str]) -> None:
    env = vm_env
    src = write_agent(tmp_path / "huge", "huge", SIZE_AGENT, line + "\n")
    before = set(await env.runtime.driver.list())
    with pytest.raises(AgentSizingError) as e:
        await env.runtime.deploy(env.principal, src)
    for w in words:
        assert w in e.value.message + " " + (e.value.hint or ""), (w, e.value.message, e.value.hint)
    assert "nothing was changed" in (e.value.hint or "")
    # Nothing booted and nothing went live.
    assert set(await env.runtime.driver.list()) == before
    ts = env.store.tenant(env.principal)
    assert all(a.live_deployment is None for a in ts.agents.list() if a.name == "huge")


async def test_operator_limit_and_malformed_sizes(vm_env: Env, tmp_path: Path) -> None:
    env = vm_env
    limited = env.cfg.with_(agent_max_memory_mib=300)
    from moorage.runtime.sizing import spec_for

    with pytest.raises(AgentSizingError, match="agent_max_memory_mib"):
        spec_for({"memory_mib": 384}, limited, env.cfg.sandboxes_dir)
    assert spec_for({"memory_mib": 300}, limited, env.cfg.sandboxes_dir).memory_mib == 300
    # Defaults: the host's guest memory, one vCPU.
    assert spec_for({}, env.cfg, env.cfg.sandboxes_dir).memory_mib == env.cfg.guest_memory_mib
    for line in ('memory_mib = "lots"', "memory_mib = 64", "vcpus = 0", "vcpus = true", "ports = [0]",
                 "ports = [8080, 8080]", 'ports = "8080"'):
        src = write_agent(tmp_path / "bad", "bad", SIZE_AGENT, line + "\n")
        with pytest.raises(AgentPackageError) as e:
            await env.runtime.deploy(env.principal, src)
        assert isinstance(e.value, InvalidInput) and "moorage.toml" in e.value.message, (line, e.value.message)
