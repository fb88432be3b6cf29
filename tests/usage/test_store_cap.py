"""The per-host measures behind ``store_mib`` (usage/store_cap.py): how often a user's store is read again.

Measuring reads every row of the user, so it must not happen per call: once when the user is first seen, once per
turn that would cross the cap, then at most every ``RECHECK_S``, and when the measure is older than
``MEASURE_EVERY_S``. The store here is a stand-in whose size the test sets; tests/client/test_sdk_store_cap.py runs
the cap through `moorage up`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moorage.usage import store_cap
from moorage.usage.store_cap import Footprints, StoreCapExceeded

MIB = 1 << 20


class _Store:
    """What the measures read of a tenant's store: its id and one user's bytes (counted reads)."""

    def __init__(self, tenant_id: str, size: int) -> None:
        self.tenant_id, self.size, self.reads = tenant_id, size, 0
        self.footprint = self
        self.agent_users = SimpleNamespace(find=lambda agent, user: None)  # no limits of the user's own

    def user_bytes(self, agent: str, user: str) -> dict[str, int]:
        self.reads += 1
        return {"memory": self.size}


class _Runtime:
    """What the cap reads of a host's runtime: the operator's ceiling (none)."""

    config = SimpleNamespace(user_max_store_mib=0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(store_cap.time, "monotonic", lambda: now[0])
    return now


async def test_calls_are_counted_between_measures_and_a_crossing_measures_again(clock: list[float]) -> None:
    fp, ts = Footprints(), _Store("acme", MIB // 2)
    assert await fp.admit(ts, "echo", "ada", 1, 100_000, "memory.append")  # first seen: measured
    for _ in range(4):  # under the cap by the count: no read
        assert not await fp.admit(ts, "echo", "ada", 1, 100_000, "memory.append")
    assert ts.reads == 1
    with pytest.raises(StoreCapExceeded, match=r"keeps 1\.0 MiB in the store, its store_mib cap is 1; memory.append"):
        await fp.admit(ts, "echo", "ada", 1, 100_000, "memory.append")  # 0.5 MiB + 5 x 100 kB: crosses, too recent
    assert ts.reads == 1
    # The first crossing of a turn measures, however recent: what was freed counts at once.
    ts.size = 0
    assert await fp.admit(ts, "echo", "ada", 1, 100_000, "memory.append", recheck=True)
    assert ts.reads == 2
    # A loop at the cap reads the store at most every RECHECK_S, not per call.
    ts.size = MIB  # full: another host wrote (the count here does not know it until a crossing measures)
    clock[0] += store_cap.RECHECK_S
    for _ in range(50):
        with pytest.raises(StoreCapExceeded):
            await fp.admit(ts, "echo", "ada", 1, MIB - 1, "memory.append")
    assert ts.reads == 3
    clock[0] += store_cap.RECHECK_S
    ts.size = 0  # freed meanwhile (a rollback on another host): the next crossing, RECHECK_S on, sees it
    assert await fp.admit(ts, "echo", "ada", 1, 1, "memory.append")


async def test_an_old_measure_is_read_again_and_users_and_tenants_are_apart(clock: list[float]) -> None:
    fp, acme, globex = Footprints(kept=2), _Store("acme", 0), _Store("globex", 2 * MIB)
    await fp.admit(acme, "echo", "ada", 1, 10, "memory.learn")
    with pytest.raises(StoreCapExceeded):  # the same agent and user names in another tenant: its own measure
        await fp.admit(globex, "echo", "ada", 1, 10, "memory.learn")
    clock[0] += store_cap.MEASURE_EVERY_S
    acme.size = 2 * MIB  # written by another host: seen once the measure is old
    with pytest.raises(StoreCapExceeded):
        await fp.admit(acme, "echo", "ada", 1, 10, "memory.learn")
    assert acme.reads == 2
    # A host keeps a bounded number of measures: the least recently written user goes first.
    await fp.admit(_Store("acme", 0), "echo", "bob", 1, 10, "memory.learn")
    await fp.admit(_Store("acme", 0), "echo", "cy", 1, 10, "memory.learn")
    assert len(fp._m) == 2 and ("acme", "echo", "ada") not in fp._m


async def test_a_remembered_text_counts_with_the_embedding_the_host_adds_to_it(clock: list[float]) -> None:
    # A turn of an agent whose users keep 1 MiB: 100-byte memories count 100 + 1536 bytes each (float32 x 384),
    # so the 641st is refused where counting frames alone would have let ~10,000 through before the next measure.
    rt, ts = _Runtime(), _Store("acme", 0)
    turn = SimpleNamespace(ts=ts, manifest={"limits": {"store_mib": 1}}, entity=SimpleNamespace(agent="echo", user="ada"),
                           store_cap_mib=None, store_cap_read=False, store_measured=False)
    kept = 0
    with pytest.raises(StoreCapExceeded):
        while True:
            await store_cap.admit(rt, turn, 100, "memory.append")
            kept += 1
    assert kept == MIB // (100 + store_cap.EMBEDDING_BYTES) == 640 and ts.reads == 1  # measured once: at the turn's first call
    await store_cap.admit(rt, turn, 100, "memory.learn")  # no embedding: what is left fits a fact
