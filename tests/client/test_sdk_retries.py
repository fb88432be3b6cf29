"""The SDK retries 429/503 honouring Retry-After, with one Idempotency-Key for every attempt of a request:
against a scripted loopback server (exact waits and headers) and against a real moorage server under overload."""

from __future__ import annotations

import asyncio
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Iterator

import pytest

from moorage import AsyncClient, Client
from moorage.client import RateLimited, Unavailable
from moorage.store import Store
from tests.api.test_retry_after import SLOW_AGENT, archive
from tests.client.loopback import Loopback, read_body, reply


class Scripted(Loopback):
    """Answers the queued (status, headers) in order, then 200; records each request's headers."""

    def __init__(self, script: list[tuple[int, dict[str, str]]]) -> None:
        self.script = list(script)
        self.seen: list[dict[str, str]] = []

        def answer(handler: BaseHTTPRequestHandler) -> None:
            read_body(handler)
            self.seen.append({k.lower(): v for k, v in handler.headers.items()})
            status, headers = self.script.pop(0) if self.script else (200, {})
            body = json.dumps({"ok": True} if status < 400 else
                              {"type": "https://moorage.dev/problems/overloaded", "status": status,
                               "detail": "busy", "hint": "retry", "trace_id": "t"}).encode()
            ctype = "application/json" if status < 400 else "application/problem+json"
            reply(handler, status, body, {**headers, "content-type": ctype})

        super().__init__(answer)


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    s = Scripted([(429, {"Retry-After": "2"}), (503, {"Retry-After": "1"})])
    yield s
    s.close()


def test_retry_after_is_honoured_with_one_idempotency_key(scripted: Scripted):
    waits: list[float] = []
    with Client(scripted.url, "mrg_x", sleep=waits.append) as sdk:
        assert sdk.invoke("a", "hi", user="u") == {"ok": True}
    assert waits == [2.0, 1.0]  # exactly what the server asked for, not a guess
    keys = {h["idempotency-key"] for h in scripted.seen}
    assert len(scripted.seen) == 3 and len(keys) == 1 and keys.pop().startswith("sdk-")


def test_a_given_key_is_kept_and_gets_are_not_keyed(scripted: Scripted):
    waits: list[float] = []
    with Client(scripted.url, "mrg_x", sleep=waits.append) as sdk:
        sdk.invoke("a", "hi", user="u", idempotency_key="mine-1")
        sdk.health()
    assert [h.get("idempotency-key") for h in scripted.seen] == ["mine-1", "mine-1", "mine-1", None]


def test_giving_up_reports_the_servers_answer():
    s = Scripted([(429, {"Retry-After": "1"})] * 3 + [(429, {"Retry-After": "3600"})])
    try:
        waits: list[float] = []
        with Client(s.url, "mrg_x", max_retries=2, sleep=waits.append) as sdk:
            with pytest.raises(RateLimited) as e:
                sdk.get_agent("a")
            assert e.value.retry_after == 1 and waits == [1.0, 1.0]  # three attempts, then the 429 is raised
            waits.clear()
            with pytest.raises(RateLimited) as e:
                sdk.get_agent("a")  # asks to wait an hour: longer than max_wait_s, handed over at once
            assert e.value.retry_after == 3600 and waits == []
    finally:
        s.close()


def test_an_unreachable_server_is_unavailable_after_backoff():
    waits: list[float] = []
    with Client("http://127.0.0.1:9", "mrg_x", max_retries=2, backoff_s=0.01, sleep=waits.append) as sdk:
        with pytest.raises(Unavailable):
            sdk.health()
    assert len(waits) == 2 and len(sdk.attempts) == 3


async def test_overloaded_server_turns_all_succeed_through_the_sdk(live_rt, store: Store, acme: str, tmp_path: Path):
    async with AsyncClient(live_rt.url, acme, max_retries=60) as sdk:
        await sdk.deploy("slow", archive(tmp_path, "slow", SLOW_AGENT.replace("sleep(6)", "sleep(1.5)"),
                                         "max_queue = 1\n"))
        first = asyncio.create_task(sdk.invoke("slow", "slow", user="ann", session="s0"))
        ts = store.tenant(store.authenticate(acme))
        while not any(run.status == "running" for run in ts.runs.list(limit=100)):
            await asyncio.sleep(0.05)
        replies = await asyncio.gather(*[sdk.invoke("slow", f"m{i}", user="ann", session=f"s{i + 1}") for i in range(4)])
        assert (await first)["reply"] == "ok: slow"
    assert sorted(r["reply"] for r in replies) == [f"ok: m{i}" for i in range(4)]
    statuses = [s for m, p, s in sdk.attempts if p == "/v1/agents/slow/invoke"]
    assert 429 in statuses  # some were refused at first and retried after the server's Retry-After
    # Each turn ran once: a retried request carried the same Idempotency-Key, and refused ones never started.
    turns = [r for r in ts.runs.list(limit=100) if r.status == "succeeded"]
    assert len(turns) == 5


def test_an_error_status_without_a_body_is_an_error_and_bad_ids_never_leave() -> None:
    """A proxy's bare 404 (or a redirect) is not a success with no answer; ``..`` in an id cannot turn a call on a
    share link into one on the user (URL rules resolve it away), so such an id is refused before sending."""
    from moorage.client import InvalidArgument, NotFound

    seen: list[str] = []

    def bare(handler: BaseHTTPRequestHandler) -> None:
        seen.append(handler.path)
        reply(handler, 404 if "missing" in handler.path else 307)

    with Loopback(bare) as server:
        with Client(server.url, api_key="k", max_retries=0) as c:
            with pytest.raises(NotFound):
                c.get_trace("missing")
            with pytest.raises(Exception) as redirected:
                c.get_trace("elsewhere")
            assert getattr(redirected.value, "status", None) == 307
            for bad in ("", ".", ".."):
                with pytest.raises(InvalidArgument, match="is not a valid id"):
                    c.delete_user("coder", bad)
    assert seen == ["/v1/traces/missing", "/v1/traces/elsewhere"]  # nothing else was sent
