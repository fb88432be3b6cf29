"""Async turns and webhooks with the real runtime and a real receiver on loopback: 202 + execution id, the
signed delivery (Standard Webhooks), retries with every attempt recorded, replay, interrupts as events, and a
delivery loop killed between attempts that still delivers exactly once after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from moorage.store import Store
from moorage.store.postgres import PostgresBackend
from moorage.webhooks import Dispatcher, RetrySchedule, verify
from moorage.webhooks.signing import InvalidSignature
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}
FAST = RetrySchedule((0.2,) * 8)


class Receiver:
    """A webhook endpoint on 127.0.0.1 that is "down" (503) for its first ``down_for`` requests."""

    def __init__(self, down_for: int = 0) -> None:
        self.down_for = down_for
        self.requests: list[tuple[dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver.lock:
                    status = 503 if len(receiver.requests) < receiver.down_for else 204
                    receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            return [(h, b) for h, b, s in self.requests if s < 300]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


async def until(predicate: Any, what: str, *, rounds: int = 2400) -> None:
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


async def deploy(c: Any, tmp_path: Path) -> None:
    assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201


async def test_async_turn_answers_202_and_its_webhook_is_signed(live_rt, store: Store, acme: str, tmp_path: Path,
                                                               receiver: Receiver):
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    loop_task = asyncio.create_task(dispatcher.run())
    try:
        async with aclient(live_rt, acme) as c:
            await deploy(c, tmp_path)
            hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url})).json()
            assert hook["secret"].startswith("whsec_")
            assert (await c.get(f"/v1/agents/echo/webhooks/{hook['id']}")).json()["secret"] is None  # shown once

            r = await c.post("/v1/agents/echo/invoke", json={"message": "stream a b", "user": "ann"},
                             headers={"Prefer": "respond-async", "Idempotency-Key": "job-1"})
            assert r.status_code == 202, r.text
            ex = r.json()
            assert r.headers["location"] == f"/v1/executions/{ex['id']}" and ex["status"] in ("queued", "running", "succeeded")
            again = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "stream a b", "user": "ann"},
                                 headers={"Idempotency-Key": "job-1"})
            assert again.status_code == 202 and again.json()["id"] == ex["id"]  # one execution per key

            await until(lambda: receiver.delivered(), "the webhook arrives")
            headers, body = receiver.delivered()[0]
            payload = verify(hook["secret"], body, headers)
            assert payload["type"] == "execution.succeeded"
            assert payload["data"]["execution_id"] == ex["id"] and payload["data"]["reply"] == "streamed"
            assert headers["webhook-signature"].startswith("v1,") and headers["webhook-id"].startswith("msg_")
            with pytest.raises(InvalidSignature):
                verify(hook["secret"], body.replace(b"streamed", b"tampered"), headers)
            with pytest.raises(InvalidSignature):
                verify("whsec_" + "A" * 32, body, headers)

            got = (await c.get(ex and f"/v1/executions/{ex['id']}")).json()
            assert got["status"] == "succeeded" and got["reply"] == "streamed" and got["user"] == "ann"
            assert "".join(e["data"]["data"] for e in got["events"] if e["kind"] == "token") == "a b "
            await asyncio.sleep(0.3)
            assert len(receiver.delivered()) == 1  # announced once, however many rounds ran
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)


async def test_interrupts_are_webhook_events_and_answers_finish_the_execution(live_rt, store: Store, acme: str,
                                                                              tmp_path: Path, receiver: Receiver):
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    loop_task = asyncio.create_task(dispatcher.run())
    try:
        async with aclient(live_rt, acme) as c:
            await deploy(c, tmp_path)
            hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url})).json()
            ex = (await c.post("/v1/agents/echo/invoke?async=true", json={"message": "approve", "user": "bo"})).json()
            await until(lambda: receiver.delivered(), "the interrupt event arrives")
            waiting = verify(hook["secret"], receiver.delivered()[0][1], receiver.delivered()[0][0])
            assert waiting["type"] == "interrupt.waiting"
            assert waiting["data"]["interrupt"]["question"] == "ship it?" and waiting["data"]["execution_id"] == ex["id"]
            view = (await c.get(f"/v1/executions/{ex['id']}")).json()
            assert view["status"] == "waiting"
            # A waiting turn names its trace already: its spans so far can be read while it waits.
            assert view["trace_id"] and (await c.get(f"/v1/traces/{view['trace_id']}")).status_code == 200
            # The exec route's cancel does not take a turn: it says how a turn is cancelled.
            wrong = await c.post(f"/v1/executions/{ex['id']}/cancel")
            assert wrong.status_code == 409 and "/v1/workflows/{run_id}/cancel" in wrong.json()["hint"], wrong.text

            done = await c.post(f"/v1/workflows/{ex['id']}/answer", json={"answer": "yes"})
            assert done.json()["reply"] == "draft-1 -> yes"
            await until(lambda: len(receiver.delivered()) == 2, "the end of the execution is announced")
            end = verify(hook["secret"], receiver.delivered()[1][1], receiver.delivered()[1][0])
            assert end["type"] == "execution.succeeded" and end["data"]["reply"] == "draft-1 -> yes"

            # A synchronous turn that stops for approval is announced too.
            sync = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "cy"})).json()
            await until(lambda: len(receiver.delivered()) == 3, "the synchronous interrupt is announced")
            third = verify(hook["secret"], receiver.delivered()[2][1], receiver.delivered()[2][0])
            assert third["type"] == "interrupt.waiting" and third["data"]["run_id"] == sync["run_id"]
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)


async def test_receiver_down_three_times_is_delivered_once_on_the_fourth_attempt(live_rt, store: Store, acme: str,
                                                                                  tmp_path: Path):
    receiver = Receiver(down_for=3)
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    loop_task = asyncio.create_task(dispatcher.run())
    try:
        async with aclient(live_rt, acme) as c:
            await deploy(c, tmp_path)
            hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url,
                                                                   "events": ["execution.succeeded"]})).json()
            await c.post("/v1/agents/echo/invoke?async=true", json={"message": "hi", "user": "dee"})
            await until(lambda: receiver.delivered(), "the fourth attempt succeeds")
            await asyncio.sleep(0.5)  # several more rounds: nothing is sent again
            assert [s for _, _, s in receiver.requests] == [503, 503, 503, 204]
            assert len({h["webhook-id"] for h, _, _ in receiver.requests}) == 1  # the same message each time

            deliveries = (await c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries")).json()["data"]
            assert len(deliveries) == 1 and deliveries[0]["status"] == "delivered" and deliveries[0]["attempts"] == 4
            d = (await c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries/{deliveries[0]['id']}")).json()
            assert [a["status_code"] for a in d["attempt_log"]] == [503, 503, 503, 204]
            assert [a["seq"] for a in d["attempt_log"]] == [1, 2, 3, 4]

            r = await c.post(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries/{d['id']}/replay")
            assert r.status_code == 202 and r.json()["status"] == "pending"
            await until(lambda: len(receiver.delivered()) == 2, "the replay is sent")
            assert receiver.delivered()[1][0]["webhook-id"] == d["id"]
            await until(lambda: len(store.tenant(store.authenticate(acme)).deliveries.attempts(d["id"])) == 5,
                        "the replay's attempt is recorded")
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        receiver.close()


_LOOP = """
import asyncio, sys
from moorage.store import Store
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend
from moorage.webhooks import Dispatcher, RetrySchedule
kind, where = sys.argv[1], sys.argv[2]
store = Store(SQLiteBackend(where) if kind == "sqlite" else PostgresBackend(where))
asyncio.run(Dispatcher(store, schedule=RetrySchedule((1.0,) * 8), poll_s=0.05).run())
"""


def _start_loop(store: Store) -> subprocess.Popen[bytes]:
    b = store.backend
    kind, where = ("postgres", b.owner_url) if isinstance(b, PostgresBackend) else ("sqlite", str(b.root))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.Popen([sys.executable, "-c", _LOOP, kind, where], env=env, cwd=root)


async def test_delivery_loop_killed_between_attempts_still_delivers_once(live_rt, store: Store, acme: str,
                                                                          tmp_path: Path):
    receiver = Receiver(down_for=2)
    first = second = None
    try:
        async with aclient(live_rt, acme) as c:
            await deploy(c, tmp_path)
            hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url,
                                                                   "events": ["interrupt.waiting"]})).json()
            await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "eve"})  # queues one delivery
        ts = store.tenant(store.authenticate(acme))
        (delivery,) = ts.deliveries.list(hook["id"])

        first = _start_loop(store)
        await until(lambda: ts.deliveries.get(delivery.id).attempts == 1, "the first attempt is recorded")
        # Killed between attempts: the second is due a second after the first, and the host dies now.
        first.send_signal(signal.SIGKILL)
        first.wait()
        after_kill = ts.deliveries.get(delivery.id)
        assert after_kill.status == "pending" and after_kill.attempts == 1

        second = _start_loop(store)
        await until(lambda: ts.deliveries.get(delivery.id).status == "delivered", "delivered after the restart")
        await asyncio.sleep(1.5)  # more rounds of the new loop: nothing is sent again
        assert [s for _, _, s in receiver.requests] == [503, 503, 204]
        assert len(receiver.delivered()) == 1
        assert [a.status_code for a in ts.deliveries.attempts(delivery.id)] == [503, 503, 204]
        payload = verify(hook["secret"], receiver.delivered()[0][1], receiver.delivered()[0][0])
        assert payload["type"] == "interrupt.waiting" and payload["data"]["user"] == "eve"
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        receiver.close()


async def test_webhooks_and_executions_do_not_cross_tenants(live_rt, acme: str, globex: str, tmp_path: Path,
                                                            receiver: Receiver):
    async with aclient(live_rt, globex) as g:
        await deploy(g, tmp_path)
        hook = (await g.post("/v1/agents/echo/webhooks", json={"url": receiver.url})).json()
        ex = (await g.post("/v1/agents/echo/invoke?async=true", json={"message": "hi", "user": "x"})).json()
    async with aclient(live_rt, acme) as a:
        await deploy(a, tmp_path)
        assert (await a.get(f"/v1/executions/{ex['id']}")).status_code == 404
        assert (await a.get(f"/v1/agents/echo/webhooks/{hook['id']}")).status_code == 404
        assert (await a.get("/v1/agents/echo/webhooks")).json()["data"] == []
        assert (await a.delete(f"/v1/agents/echo/webhooks/{hook['id']}")).status_code == 404
        r = await a.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries")
        assert r.status_code == 404 and "msg_" not in r.text and hook["secret"] not in r.text


async def test_deliveries_obey_the_egress_address_policy(live_rt, store: Store, acme: str, tmp_path: Path,
                                                         receiver: Receiver):
    """A webhook URL on the host's own network (loopback here) is refused unless the operator admits it."""
    from moorage.config import Config
    from moorage.egress.connector import Egress

    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        hook = (await c.post("/v1/agents/echo/webhooks", json={"url": receiver.url})).json()
        await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "zed"})  # one delivery queued
    ts = store.tenant(store.authenticate(acme))
    (d,) = ts.deliveries.list(hook["id"])

    guarded = Dispatcher(store, schedule=RetrySchedule((0.05,) * 3),
                         egress=Egress.from_config(Config(data_dir=tmp_path / "x")))
    await guarded.tick()
    await guarded.aclose()
    (attempt,) = ts.deliveries.attempts(d.id)
    assert attempt.status_code is None and "loopback" in (attempt.error or ""), attempt.error
    assert receiver.requests == []  # nothing was sent

    await asyncio.sleep(0.1)
    admitted = Dispatcher(store, schedule=FAST,
                          egress=Egress.from_config(Config(data_dir=tmp_path / "x", egress_allow_cidrs="127.0.0.0/8")))
    await admitted.tick()
    await admitted.aclose()
    assert ts.deliveries.get(d.id).status == "delivered"
    payload = verify(hook["secret"], receiver.delivered()[0][1], receiver.delivered()[0][0])
    assert payload["type"] == "interrupt.waiting"


async def test_an_execution_refused_after_its_202_fails_and_is_announced(live_rt, store: Store, acme: str,
                                                                          tmp_path: Path, receiver: Receiver,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """Refused as overloaded past the time an execution keeps trying (none here; tests/webhooks/
    test_execution_refusals.py has it wait and run): it fails, and the failure is announced."""
    from moorage.webhooks import executions
    from tests.api.test_retry_after import SLOW_AGENT, archive

    monkeypatch.setattr(executions, "REFUSED_RETRY_FOR_S", 0.0)
    dispatcher = Dispatcher(store, schedule=FAST, poll_s=0.05)
    loop_task = asyncio.create_task(dispatcher.run())
    try:
        async with aclient(live_rt, acme) as c:
            r = await c.post("/v1/agents/slow/deployments", headers=GZ,
                             content=archive(tmp_path, "slow", SLOW_AGENT.replace("sleep(6)", "sleep(3)"), "max_queue = 1\n"))
            assert r.status_code == 201
            hook = (await c.post("/v1/agents/slow/webhooks", json={"url": receiver.url,
                                                                   "events": ["execution.failed"]})).json()
            first = asyncio.create_task(c.post("/v1/agents/slow/invoke", json={"message": "slow", "user": "ann"}))
            ts = store.tenant(store.authenticate(acme))
            while not any(run.status == "running" for run in ts.runs.list(limit=100)):
                await asyncio.sleep(0.05)
            ids = [(await c.post("/v1/agents/slow/invoke?async=true",
                                 json={"message": f"m{i}", "user": "ann", "session": f"s{i}"})).json()["id"]
                   for i in range(4)]
            await first
            shown = [(await c.get(f"/v1/executions/{i}")).json() for i in ids]
            while any(s["status"] in ("queued", "running") for s in shown):
                await asyncio.sleep(0.1)
                shown = [(await c.get(f"/v1/executions/{i}")).json() for i in ids]
        failed = {s["id"] for s in shown if s["status"] == "failed"}
        assert len(failed) >= 2 and all("too many turns" in (s["error"] or "") for s in shown if s["id"] in failed)
        await until(lambda: len(receiver.delivered()) == len(failed), "each refusal is announced")
        await asyncio.sleep(0.3)
        events = [verify(hook["secret"], b, h) for h, b in receiver.delivered()]
        assert {e["data"]["execution_id"] for e in events} == failed and len(events) == len(failed)
        assert all(e["type"] == "execution.failed" for e in events)
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)


async def test_end_user_tokens_submit_and_read_only_their_own_executions(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        await deploy(c, tmp_path)
        ann = (await c.post("/v1/agents/echo/users/ann/tokens", json={})).json()["token"]
        bob = (await c.post("/v1/agents/echo/users/bob/tokens", json={})).json()["token"]
    async with aclient(live_rt, ann) as a:
        r = await a.post("/v1/agents/echo/invoke", json={"message": "mine"}, headers={"Prefer": "respond-async"})
        assert r.status_code == 202 and r.json()["user"] == "ann"
        ex = r.json()["id"]
        while (await a.get(f"/v1/executions/{ex}")).json()["status"] != "succeeded":
            await asyncio.sleep(0.05)
        assert (await a.get(f"/v1/executions/{ex}")).json()["reply"] == "echo: mine"
    async with aclient(live_rt, bob) as b:
        assert (await b.get(f"/v1/executions/{ex}")).status_code == 404  # another user's execution: not found
