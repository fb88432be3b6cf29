"""`GET /readyz` (api/readiness.py): what a load balancer asks before it sends a host new requests. Ready while the
host serves; 503 with why while it stops (and drains, and while its store does not answer: tests/fleet/test_fleet.py
and tests/outage/test_postgres_host.py, with a real fleet and a real PostgreSQL outage). It needs no credential,
so callers share one look at the store per second however many they are."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from moorage.api.readiness import STORE_TTL_S
from tests.api.conftest import aclient, live_rt, runtime  # noqa: F401  (fixtures)


async def test_ready_while_serving_and_not_while_stopping(live_rt: Any, runtime: Any) -> None:  # noqa: F811
    async with aclient(live_rt) as anon:
        r = await anon.get("/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}, r.text
        assert (await anon.get("/healthz")).status_code == 200
        runtime.stopping.set()  # as the stop signal arrives (Host.stopping)
        try:
            r = await anon.get("/readyz")
            assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
            assert r.json()["status"] == "stopping" and "turns in flight finish" in r.json()["detail"], r.text
            assert (await anon.get("/healthz")).status_code == 200  # alive all the same
        finally:
            runtime.stopping.clear()
        assert (await anon.get("/readyz")).status_code == 200


async def test_many_probes_share_one_look_at_the_store(live_rt: Any, runtime: Any) -> None:  # noqa: F811
    store, looks = runtime.store, []
    real = store.ping

    def counted() -> None:
        looks.append(1)
        real()

    store.ping = counted  # the same store, its round trips counted
    async with aclient(live_rt) as anon:
        started = time.monotonic()
        answers = await asyncio.gather(*(anon.get("/readyz") for _ in range(50)))
        took = time.monotonic() - started
    assert {r.status_code for r in answers} == {200}
    assert 1 <= len(looks) <= 1 + int(took / STORE_TTL_S), (len(looks), took)  # once a second at most
