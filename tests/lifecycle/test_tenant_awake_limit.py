"""A tenant's awake instances on one host are capped: at the cap its least recently active idle instance is put
to sleep for the newcomer; with all of them mid-turn the newcomer is refused (429); other tenants are untouched.
The host takes the caps from its config."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.lifecycle.manager import TenantAwakeLimit
from moorage.runtime.host import Host
from moorage.store import Scope
from tests.lifecycle.test_manager_env import PROCESS_ONLY, LcEnv, lc_env  # noqa: F401  (fixture)

ALICE, BOB, CAROL = (Scope.for_user("helper", u) for u in ("alice", "bob", "carol"))


@pytest.mark.parametrize("lc_env", PROCESS_ONLY, indirect=True)
async def test_a_tenant_at_its_cap_sleeps_its_own_idle_instance_first(lc_env: LcEnv) -> None:
    env = lc_env
    _, key = env.store.operator.create_tenant("globex")
    other = env.store.tenant(env.store.authenticate(key.secret))
    m = env.manager()
    m.tenant_max_awake = 1
    async with m.turn(other, CAROL, env.template):  # another tenant's instance: not counted, never evicted
        pass
    async with m.turn(env.ts, ALICE, env.template):
        pass
    async with m.turn(env.ts, BOB, env.template):
        pass
    assert env.ts.sandboxes.for_scope(ALICE).state == "sleeping"
    assert env.ts.sandboxes.for_scope(BOB).state == "running"
    assert other.sandboxes.for_scope(CAROL).state == "running"

    release = asyncio.Event()

    async def hold_bob() -> None:
        async with m.turn(env.ts, BOB, env.template):
            await release.wait()

    holder = asyncio.create_task(hold_bob())
    while not m.live(env.ts, BOB).activity.busy:
        await asyncio.sleep(0.01)
    with pytest.raises(TenantAwakeLimit) as refused:
        async with m.turn(env.ts, ALICE, env.template):
            pass
    assert refused.value.http_status == 429 and refused.value.retry_after > 0
    release.set()
    await holder
    assert env.ts.sandboxes.for_scope(ALICE).state == "sleeping"  # nothing was woken for the refused turn


def test_the_host_reads_its_caps_from_config(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "d", sandbox_driver="process", max_awake_instances=8, max_awake_ram_mib=4096,
                 max_awake_per_tenant=2)
    host = Host.open(cfg)
    try:
        assert (host.manager.capacity.max_awake, host.manager.capacity.max_ram_mib) == (8, 4096)
        assert host.manager.tenant_max_awake == 2
    finally:
        host.store.close()
