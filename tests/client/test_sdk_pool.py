"""A client with more calls in flight than its pool's connections makes the next one wait for a connection; when that
wait runs out the error says so (the call was never sent: make fewer calls at once or raise ``max_connections``), not
"cannot reach" the server, and it is not retried. Sync and async alike."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Iterator

import pytest

from moorage import AsyncClient, Client
from moorage.client import PoolExhausted
from tests.client.loopback import Loopback, reply


def respond(handler: BaseHTTPRequestHandler) -> None:
    if not handler.path.endswith("/output"):
        reply(handler, 200, b'{"kind": "key", "scopes": ["admin"]}', {"content-type": "application/json"})
        return
    # An exec's output, slowly: it holds its connection for 3 s, never silent for long enough to time out.
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.end_headers()
    for i in range(15):
        handler.wfile.write(f"event: output\ndata: {{\"offset\": {i}}}\n\n".encode())
        handler.wfile.flush()
        time.sleep(0.2)


@pytest.fixture
def server() -> Iterator[Loopback]:
    with Loopback(respond) as lb:
        yield lb


def test_a_call_that_waits_too_long_for_a_connection_says_the_pool_is_exhausted(server: Loopback) -> None:
    waits: list[float] = []
    with Client(server.url, "mrg_x", timeout_s=1, max_connections=2, sleep=waits.append) as sdk:
        assert sdk.whoami()["kind"] == "key"
        first: list[int] = []
        followers = [threading.Thread(target=lambda: first.append(len(list(sdk.follow_exec("exec_1")))))
                     for _ in range(2)]
        for t in followers:
            t.start()
        time.sleep(0.3)  # both connections taken by the two streams
        with pytest.raises(PoolExhausted) as e:
            sdk.whoami()
        for t in followers:
            t.join()
    assert first == [15, 15]  # the calls that held the connections were not disturbed
    error = e.value
    assert error.code == "pool-exhausted" and "cannot reach" not in str(error), error
    assert "all 2 connections of this client" in error.detail and "not sent" in error.detail
    assert "max_connections" in (error.hint or "") and "fewer calls at once" in (error.hint or "")
    assert waits == [], "it was retried"


async def test_the_async_client_says_so_too(server: Loopback) -> None:
    async with AsyncClient(server.url, "mrg_x", timeout_s=1, max_connections=1) as sdk:
        async def follow() -> int:
            return len([ev async for ev in sdk.follow_exec("exec_1")])

        holder = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        with pytest.raises(PoolExhausted) as e:
            await sdk.whoami()
        assert await holder == 15
    assert "all 1 connections" in e.value.detail and "max_connections" in (e.value.hint or "")
    assert len([a for a in sdk.attempts if a[2] == 0]) == 1  # one attempt, not retried
