"""``/metrics`` of a live host, read as someone writing alerts: every path a user's work takes shows in it, with
bounded labels."""

from __future__ import annotations

import pytest

from tests.observability.conftest import LiveHost, archive, value

pytestmark = pytest.mark.timeout(240)


async def test_scrapes_are_their_own_route_not_unmatched(live_host: LiveHost) -> None:
    async with live_host.client() as c:
        assert (await c.get("/openapi.json")).status_code == 200
    await live_host.scrape()
    samples = await live_host.scrape()
    assert value(samples, "moorage_http_requests_total", route="/metrics", method="GET", status="200") >= 1
    assert value(samples, "moorage_http_requests_total", route="/openapi.json", status="200") == 1
    assert value(samples, "moorage_http_requests_total", route="unmatched") == 0


async def test_every_wake_fork_sleep_and_checkpoint_is_timed_with_its_outcome(live_host: LiveHost) -> None:
    async with live_host.client() as c:
        r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})  # a new instance: a fork
        assert r.status_code == 200, r.text
        (box,) = (await c.get("/v1/sandboxes")).json()["data"]
        r = await c.post(f"/v1/sandboxes/{box['id']}/sleep")
        assert r.status_code == 200, r.text
        # The turn wakes it (not the wake route): that wake is timed as much as one the route asks for.
        r = await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"] == "echo: again", r.text
        r = await c.post("/v1/agents/echo/users/ada/checkpoints", json={"name": "before"})
        assert r.status_code in (200, 201), r.text
    samples = await live_host.scrape()
    assert value(samples, "moorage_fork_seconds_count", outcome="ok") == 1
    assert value(samples, "moorage_sleep_seconds_count", outcome="ok") == 1
    assert value(samples, "moorage_wake_seconds_count", outcome="ok") == 1
    assert value(samples, "moorage_checkpoint_seconds_count", outcome="ok", kind="manual") == 1


async def test_turns_are_counted_by_outcome_and_failure_code(live_host: LiveHost) -> None:
    async with live_host.client() as c:
        r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        r = await c.post("/v1/agents/echo/invoke", json={"message": "fail", "user": "ada"})
        assert r.status_code == 502 and r.json()["type"].endswith("agent-error"), r.text
        r = await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "bob"})
        assert r.status_code == 200 and r.json()["status"] == "waiting", r.text
    samples = await live_host.scrape()
    assert value(samples, "moorage_turn_seconds_count", outcome="done") == 1
    assert value(samples, "moorage_turn_seconds_count", outcome="failed") == 1
    assert value(samples, "moorage_turn_seconds_count", outcome="waiting") == 1
    assert value(samples, "moorage_turn_failures_total", code="agent-error") == 1


SLOW = '''
import asyncio

async def on_message(ctx, message):
    await asyncio.sleep(30)
    return "too late"
'''


async def test_a_cancelled_turn_is_counted_as_cancelled(live_host: LiveHost) -> None:
    import asyncio

    async with live_host.client() as c:
        r = await c.post("/v1/agents/slow/deployments", content=archive("slow", SLOW),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        ex = (await c.post("/v1/agents/slow/invoke?async=true", json={"message": "hi", "user": "ada"})).json()
        for _ in range(400):  # until it runs in the agent
            view = (await c.get(f"/v1/executions/{ex['id']}")).json()
            if view["status"] == "running":
                break
            await asyncio.sleep(0.05)
        r = await c.post(f"/v1/workflows/{view['run_id']}/cancel")  # a turn is cancelled as its run
        assert r.status_code in (200, 202), r.text
        for _ in range(400):
            samples = await live_host.scrape()
            if value(samples, "moorage_turn_seconds_count", outcome="cancelled"):
                break
            await asyncio.sleep(0.05)
    assert value(samples, "moorage_turn_seconds_count", outcome="cancelled") == 1
    assert value(samples, "moorage_turn_seconds_count", outcome="failed") == 0


async def test_a_sleep_the_store_could_not_record_is_counted_with_its_outcome(
        live_host: LiveHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a sleep whose sandbox failed was counted: one whose snapshot was written but whose record found the disk
    full (SQLite's own error at exactly that write) answered 507 and did not show in ``moorage_sleep_seconds``."""
    import sqlite3

    from moorage.lifecycle.sleeping import Sleeping

    real, refused = Sleeping._mark_slept, []

    def mark_slept(self, *args, **kw):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(True)
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, *args, **kw)

    monkeypatch.setattr(Sleeping, "_mark_slept", mark_slept)
    async with live_host.client() as c:
        r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        (box,) = (await c.get("/v1/sandboxes")).json()["data"]
        r = await c.post(f"/v1/sandboxes/{box['id']}/sleep")
        assert r.status_code == 507 and r.json()["type"].endswith("disk-full"), r.text
        assert refused
    samples = await live_host.scrape()
    assert value(samples, "moorage_sleep_seconds_count", outcome="disk-full") == 1
    assert value(samples, "moorage_sleep_seconds_count", outcome="ok") == 0


async def test_a_wake_the_store_could_not_record_is_counted_with_its_outcome(
        live_host: LiveHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake whose sandbox came up but whose record the store could not take (PostgreSQL not answering, here
    its error raised at exactly that write) failed its turn without showing in ``moorage_wake_seconds``; the
    instance is recorded once the store answers, and the next turn is served."""
    import asyncio

    from moorage.errors import StoreUnreachable
    from moorage.lifecycle.bring_up import BringUp
    from moorage.lifecycle.machine import Verb

    real, refused = BringUp._mark_running, []

    def mark_running(self, ts, rec, verb, *args, **kw):  # type: ignore[no-untyped-def]
        if verb is Verb.WOKE and not refused:
            refused.append(True)
            raise StoreUnreachable("the store could not be reached")
        return real(self, ts, rec, verb, *args, **kw)

    monkeypatch.setattr(BringUp, "_mark_running", mark_running)
    async with live_host.client() as c:
        r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        (box,) = (await c.get("/v1/sandboxes")).json()["data"]
        assert (await c.post(f"/v1/sandboxes/{box['id']}/sleep")).status_code == 200
        r = await c.post("/v1/agents/echo/invoke", json={"message": "woken", "user": "ada"})
        assert r.status_code == 503, r.text
        assert refused
        samples = await live_host.scrape()
        assert value(samples, "moorage_wake_seconds_count", outcome="store-unreachable") == 1
        for _ in range(100):  # recorded once the store answers (tried every second)
            r = await c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "ada"})
            if r.status_code == 200:
                break
            await asyncio.sleep(0.2)
        assert r.status_code == 200 and r.json()["reply"] == "echo: again", r.text
