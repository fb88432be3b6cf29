"""A host keeps its leases while all its worker threads are busy: the heartbeat has a thread of its own, so blocking
work queued on the default executor (shipments during a drain, each longer than the lease) does not hold it back
until other hosts take the host for dead and claim its instances."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from moorage import clock
from moorage.fleet.hosts import HostRegistry
from moorage.fleet.member import FleetMember
from moorage.objects.local import LocalObjectStore
from moorage.store.sqlite import SQLiteBackend
from tests.fleet.test_ship_retry import _Driver

LEASE_S, BEAT_S = 1.0, 0.1


def test_a_host_whose_worker_threads_are_all_busy_keeps_its_leases(tmp_path: Path) -> None:
    async def run() -> None:
        member = FleetMember(SQLiteBackend(tmp_path / "store"), LocalObjectStore(tmp_path / "objects"),
                             _Driver(tmp_path / "sandboxes"), host_id="h1", url="http://127.0.0.1:1",
                             lease_ttl_s=LEASE_S, heartbeat_s=BEAT_S)
        other_host = HostRegistry(SQLiteBackend(tmp_path / "store"))
        await member.join()
        try:
            # Every thread of the default executor blocked three leases long, and as much work queued behind them.
            threads = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's size
            busy = [asyncio.to_thread(time.sleep, 3 * LEASE_S) for _ in range(2 * threads)]
            blocked = asyncio.ensure_future(asyncio.gather(*busy))
            ages, t0 = [], time.monotonic()
            while time.monotonic() - t0 < 2.5 * LEASE_S:
                info = other_host.get("h1")  # as another host reads the row (blocking, as it would)
                ages.append(clock.now() - info.heartbeat_at)
                await asyncio.sleep(BEAT_S / 2)
            assert not blocked.done()  # the executor was still full all along
            assert max(ages) < LEASE_S, max(ages)  # never old enough for another host to take h1 for dead
            await blocked
        finally:
            await member.leave()

    asyncio.run(run())
