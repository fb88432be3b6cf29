"""The per-host measures behind the operator's ``tenant_max_storage_mib`` (usage/tenant_cap.py): how often a
tenant is measured (on PostgreSQL a read of every row of it), what counts between measures, and what a write past
the ceiling gets. The measure here is a stand-in whose size the test sets; tests/client/test_sdk_tenant_storage.py
runs the ceiling through `moorage up`, tests/store/test_footprint.py measures real stores."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from moorage.usage import tenant_cap
from moorage.usage.tenant_cap import RECHECK_S, TenantLevels, TenantStorageExceeded

MIB = 1 << 20


class _Sizes:
    """The tenants' sizes the stand-in measure reads, and how often each was read."""

    def __init__(self) -> None:
        self.size: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        self.gate: threading.Event | None = None  # set: measures wait for it (a slow PostgreSQL scan)

    def measure(self, ts: SimpleNamespace) -> dict[str, int]:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.reads[ts.tenant_id] = self.reads.get(ts.tenant_id, 0) + 1
        return {"store": self.size.get(ts.tenant_id, 0), "instances": 0}


@pytest.fixture
def sizes(monkeypatch: pytest.MonkeyPatch) -> _Sizes:
    s = _Sizes()
    monkeypatch.setattr(tenant_cap, "measure", s.measure)
    return s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(tenant_cap, "_now", lambda: now[0])  # not time.monotonic: the event loop's clock
    return now


class _Backend:
    """The store a tenant's view belongs to (the measures are kept per store), with the tenants' own limits as the
    operator set them (counted reads)."""

    def __init__(self) -> None:
        self.limits: dict[str, dict] = {}
        self.reads = 0

    def tenant_limits(self, tenant_id: str) -> dict:
        self.reads += 1
        return dict(self.limits.get(tenant_id, {}))


def _ts(tenant_id: str, backend: _Backend | None = None) -> SimpleNamespace:
    return SimpleNamespace(tenant_id=tenant_id, backend=backend or _Backend())


async def test_writes_are_counted_between_measures_and_a_crossing_measures_again(sizes: _Sizes,
                                                                                 clock: list[float]) -> None:
    lv, acme = TenantLevels(), _ts("acme")
    sizes.size["acme"] = 3 * MIB
    await lv.admit(acme, 4, 100_000, "memory.append")  # first seen: measured
    for _ in range(9):  # 3 MiB + 10 x 100 kB: under 4 MiB by the count, no read
        await lv.admit(acme, 4, 100_000, "memory.append")
    assert sizes.reads == {"acme": 1}
    with pytest.raises(TenantStorageExceeded, match=r"this tenant keeps 4\.0 MiB .* its storage ceiling is 4 MiB; "
                                                    r"memory\.append refused"):
        await lv.admit(acme, 4, 100_000, "memory.append")  # crosses; the measure is too recent to read again
    assert sizes.reads == {"acme": 1}
    # Another host deleted users: a crossing reads again once the measure is RECHECK_S old, and the room counts.
    sizes.size["acme"] = MIB
    clock[0] += RECHECK_S
    await lv.admit(acme, 4, 100_000, "memory.append")
    assert sizes.reads == {"acme": 2}
    # Another host filled it: a write that crosses by the count reads again and is refused; a loop at the
    # ceiling then reads at most every RECHECK_S, not per call.
    sizes.size["acme"] = 4 * MIB
    clock[0] += RECHECK_S
    with pytest.raises(TenantStorageExceeded):
        await lv.admit(acme, 4, 3 * MIB, "memory.append")
    assert sizes.reads == {"acme": 3}
    for _ in range(50):
        clock[0] += 0.5
        with pytest.raises(TenantStorageExceeded):
            await lv.admit(acme, 4, 100_000, "memory.append")
    assert sizes.reads["acme"] == 3 + 2, sizes.reads  # 25 s: at 10 and 20 s


async def test_an_old_measure_is_taken_again_behind_the_write_that_finds_it(sizes: _Sizes,
                                                                            clock: list[float]) -> None:
    """A measure older than MEASURE_EVERY_S is read again in the background: the write is not held behind a scan
    of the tenant, and is judged by the measure it found."""
    lv, acme = TenantLevels(), _ts("acme")
    await lv.admit(acme, 4, 0, "memory.append")
    sizes.gate = threading.Event()
    clock[0] += tenant_cap.MEASURE_EVERY_S
    await asyncio.wait_for(lv.admit(acme, 4, 100_000, "memory.append"), 5)  # admitted at once
    await asyncio.wait_for(lv.admit(acme, 4, 100_000, "memory.append"), 5)  # one measure behind, not two
    sizes.size["acme"] = 5 * MIB
    sizes.gate.set()
    for _ in range(100):
        if sizes.reads["acme"] == 2:
            break
        await asyncio.sleep(0.02)
    assert sizes.reads == {"acme": 2}
    with pytest.raises(TenantStorageExceeded, match=r"keeps 5\.0 MiB"):  # the new measure judges the next write
        await lv.admit(acme, 4, 0, "a new instance")


async def test_an_instances_sleep_counts_at_once_and_a_forget_measures_again(sizes: _Sizes,
                                                                            clock: list[float]) -> None:
    lv, acme = TenantLevels(), _ts("acme")
    sizes.size["acme"] = 3 * MIB
    await lv.admit(acme, 4, 0, "a new instance")
    lv.grew("acme", 2 * MIB)  # its disk and snapshot at its sleep (lifecycle/sleeping.py)
    with pytest.raises(TenantStorageExceeded, match=r"keeps 5\.0 MiB .* a new instance refused"):
        await lv.admit(acme, 4, 0, "a new instance")
    lv.freed("acme")  # a user forgotten on this host: the next write reads the tenant again, however recent
    sizes.size["acme"] = MIB
    await lv.admit(acme, 4, 0, "a new instance")
    assert sizes.reads == {"acme": 2}
    lv.grew("globex", MIB)  # a tenant never measured here: nothing to add to


async def test_tenants_are_measured_and_counted_apart(sizes: _Sizes, clock: list[float]) -> None:
    lv = TenantLevels()
    sizes.size.update(acme=4 * MIB, globex=0)
    with pytest.raises(TenantStorageExceeded):
        await lv.admit(_ts("acme"), 4, 1, "memory.append")
    await lv.admit(_ts("globex"), 4, 3 * MIB, "memory.append")
    assert sizes.reads == {"acme": 1, "globex": 1}


def test_usage_shows_the_standing_only_under_a_ceiling(sizes: _Sizes, clock: list[float]) -> None:
    acme = _ts("acme")
    sizes.size["acme"] = 3 * MIB
    assert tenant_cap.standing(SimpleNamespace(tenant_max_storage_mib=0), acme) is None
    assert sizes.reads == {}  # no ceiling: the tenant is not measured
    shown = tenant_cap.standing(SimpleNamespace(tenant_max_storage_mib=8), acme)
    assert shown == {"limit": 8.0, "used": 3.0, "store_bytes": 3 * MIB, "instance_bytes": 0, "package_bytes": 0}
    assert tenant_cap.standing(SimpleNamespace(tenant_max_storage_mib=8), acme) == shown
    assert sizes.reads == {"acme": 1}  # within RECHECK_S: the same measure


async def test_a_tenants_own_ceiling_replaces_the_default_and_is_read_again_each_minute(sizes: _Sizes,
                                                                                       clock: list[float]) -> None:
    """``moorage store tenant-limits``: a tenant's own ``storage_mib`` (higher or lower than the default, 0: none)
    applies instead of the operator's ``tenant_max_storage_mib``; a host reads it at most every LIMITS_EVERY_S."""
    backend = _Backend()
    acme, globex, initech = (_ts(t, backend) for t in ("acme", "globex", "initech"))
    backend.limits = {"acme": {"storage_mib": 8}, "globex": {"storage_mib": 0}}
    sizes.size.update(acme=5 * MIB, globex=50 * MIB, initech=5 * MIB)
    default = SimpleNamespace(tenant_max_storage_mib=4)
    await tenant_cap.admit(default, acme, MIB, "memory.append")  # its 8 MiB, not the default's 4
    await tenant_cap.admit(default, globex, MIB, "memory.append")  # 0: no ceiling, and not measured
    with pytest.raises(TenantStorageExceeded, match="its storage ceiling is 4 MiB"):
        await tenant_cap.admit(default, initech, MIB, "memory.append")  # none of its own: the default
    assert sizes.reads == {"acme": 1, "initech": 1} and backend.reads == 3
    for _ in range(20):  # read once a minute, not per call
        await tenant_cap.admit(default, acme, 1, "memory.append")
    assert backend.reads == 3
    backend.limits["acme"] = {"storage_mib": 5}  # the operator lowers it: applied at the first write a minute on
    await tenant_cap.admit(default, acme, 1, "memory.append")
    clock[0] += tenant_cap.LIMITS_EVERY_S
    with pytest.raises(TenantStorageExceeded, match="its storage ceiling is 5 MiB"):
        await tenant_cap.admit(default, acme, MIB, "memory.append")
    assert tenant_cap.standing(default, globex) is None  # no ceiling: nothing shown, nothing measured
    assert "globex" not in sizes.reads
    shown = tenant_cap.standing(SimpleNamespace(tenant_max_storage_mib=0), acme)  # its own, with no default
    assert shown is not None and shown["limit"] == 5, shown
    ephemeral = SimpleNamespace(tenant_id="acme", backend=SimpleNamespace(ephemeral=True))
    await tenant_cap.admit(default, ephemeral, 100 * MIB, "memory.append")  # a zero-retention store: not counted
