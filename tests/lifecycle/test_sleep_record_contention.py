"""A sleep whose record the store aborted (PostgreSQL broke a deadlock with a concurrent sleep or forget: its ledger
rows are shared) is recorded again, not left claimed with every turn for the instance waiting for the claim to lapse."""

from __future__ import annotations

import asyncio

import pytest

from moorage.lifecycle import sleeping
from moorage.lifecycle.policies import FixedTimeout
from moorage.store import Scope
from moorage.store.base import StoreContention
from tests.lifecycle.test_manager_env import TEMPLATE_FILE, LcEnv, forward, lc_env  # noqa: F401  (fixture)

ALICE = Scope.for_user("helper", "alice")


@pytest.mark.parametrize("lc_env", ["process-postgres"], indirect=True)
async def test_a_sleep_whose_record_the_store_aborted_is_recorded_again(lc_env: LcEnv,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the sleep answered 503 though the instance had slept, its record stayed "suspending", and a turn for
    it waited the claim's 120 s out."""
    env = lc_env
    m = env.manager(policy=FixedTimeout(3600))
    async with m.turn(env.ts, ALICE, env.template) as sb:
        await sb.write_file("note.txt", b"kept")
    real = sleeping.usage_ledger.record
    lost: list[int] = []

    def aborted_twice(ts, rec, sizes):  # the last write of the sleep's transaction, where a deadlock breaks it
        if len(lost) < 2:
            lost.append(1)
            raise StoreContention("the store aborted this change to break a conflict with a concurrent one")
        return real(ts, rec, sizes)

    monkeypatch.setattr(sleeping.usage_ledger, "record", aborted_twice)
    assert await m.sleep(env.ts, ALICE)
    assert lost == [1, 1]
    rec = env.ts.sandboxes.for_scope(ALICE)
    assert rec is not None and rec.state == "sleeping"
    # Recorded once: the aborted transactions kept none of their ledger rows.
    assert env.ts.read("SELECT COUNT(*) FROM usage WHERE kind = 'compute_seconds'") == [(1,)]
    assert env.ts.read("SELECT COUNT(*) FROM usage WHERE kind = 'disk_bytes'") == [(1,)]
    async with asyncio.timeout(30):  # served at once (a claim left behind held it 120 s)
        async with m.turn(env.ts, ALICE, env.template) as sb:
            assert await forward(sb, {"op": "read", "path": "note.txt"}) == "kept"
            assert await sb.read_file(TEMPLATE_FILE) == b"prepared in the template"
    assert m.stats.wakes == 1
