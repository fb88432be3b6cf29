"""Streams (``stream``, ``follow_exec``) fail the way every other method does: a server that cannot be reached is
retried and then ``Unavailable``, never a bare transport exception; a connection cut after the first events is
``Unavailable`` too, and is not sent again (those events were handed over). Sync and async alike."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Iterator

import pytest

from moorage import AsyncClient, Client
from moorage.client import Unavailable
from tests.client.loopback import Loopback, read_body, reply

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


def test_an_unreachable_server_stream_is_retried_then_unavailable() -> None:
    waits: list[float] = []
    with Client(CLOSED, "mrg_x", max_retries=2, backoff_s=0.01, sleep=waits.append) as sdk:
        with pytest.raises(Unavailable) as e:
            list(sdk.stream("bot", "hi", user="u"))
        assert e.value.code == "unreachable" and len(waits) == 2 and len(sdk.attempts) == 3
        with pytest.raises(Unavailable):
            list(sdk.follow_exec("exec_1"))
        assert len(sdk.attempts) == 6


async def test_an_unreachable_server_stream_is_unavailable_on_the_async_client_too() -> None:
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    async with AsyncClient(CLOSED, "mrg_x", max_retries=2, backoff_s=0.01, sleep=sleep) as sdk:
        with pytest.raises(Unavailable) as e:
            [ev async for ev in sdk.stream("bot", "hi", user="u")]
        assert e.value.code == "unreachable" and len(waits) == 2 and len(sdk.attempts) == 3
        with pytest.raises(Unavailable):
            [ev async for ev in sdk.follow_exec("exec_1")]
        assert len(sdk.attempts) == 6


class CutOff:
    """Answers every request with a stream that sends one event and then drops the connection mid-body."""

    def __init__(self) -> None:
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            conn.recv(65536)
            chunk = b'event: token\ndata: {"data": "x"}\n\n'
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            conn.close()  # no last chunk: the body is cut short

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def cut_off() -> Iterator[CutOff]:
    s = CutOff()
    yield s
    s.close()


def test_a_stream_cut_after_its_first_event_is_unavailable_and_not_resent(cut_off: CutOff) -> None:
    got: list[Any] = []
    with Client(cut_off.url, "mrg_x", max_retries=3, sleep=lambda s: None) as sdk:
        with pytest.raises(Unavailable) as e:
            for ev in sdk.stream("bot", "hi", user="u"):
                got.append(ev)
    assert got == [{"event": "token", "data": {"data": "x"}}] and "cut off" in e.value.detail
    assert cut_off.requests == 1


async def test_an_async_stream_cut_after_its_first_event_is_unavailable(cut_off: CutOff) -> None:
    got: list[Any] = []
    async with AsyncClient(cut_off.url, "mrg_x", max_retries=3, sleep=lambda s: asyncio.sleep(0)) as sdk:
        with pytest.raises(Unavailable):
            async for ev in sdk.stream("bot", "hi", user="u"):
                got.append(ev)
    assert got == [{"event": "token", "data": {"data": "x"}}] and cut_off.requests == 1


class FailsMidway(Loopback):
    """A complete stream whose turn failed after its first event: a ``token``, then the ``error`` event."""

    BODY = (b'event: token\ndata: {"event": "token", "data": "partial "}\n\n'
            b'event: error\ndata: {"type": "agent-error", "status": 502, "detail": "agent raised RuntimeError: boom", '
            b'"hint": "RuntimeError: boom", "trace_id": "t-1"}\n\n')

    def __init__(self) -> None:
        self.requests = 0

        def answer(handler: BaseHTTPRequestHandler) -> None:
            self.requests += 1
            read_body(handler)
            reply(handler, 200, self.BODY, {"content-type": "text/event-stream"})

        super().__init__(answer)


@pytest.fixture
def fails_midway() -> Iterator[FailsMidway]:
    s = FailsMidway()
    yield s
    s.close()


def test_a_turn_failing_after_its_first_event_raises_as_invoke_would(fails_midway: FailsMidway) -> None:
    from moorage.client import ServerError

    got: list[Any] = []
    with Client(fails_midway.url, "mrg_x", sleep=lambda s: None) as sdk:
        with pytest.raises(ServerError) as e:
            for ev in sdk.stream("bot", "hi", user="u"):
                got.append(ev)
    assert got == [{"event": "token", "data": {"event": "token", "data": "partial "}}]
    assert e.value.status == 502 and e.value.code == "agent-error" and e.value.trace_id == "t-1"
    assert "RuntimeError: boom" in e.value.detail and fails_midway.requests == 1  # the turn had started: not sent again


async def test_an_async_stream_failing_after_its_first_event_raises(fails_midway: FailsMidway) -> None:
    from moorage.client import ServerError

    got: list[Any] = []
    async with AsyncClient(fails_midway.url, "mrg_x") as sdk:
        with pytest.raises(ServerError) as e:
            async for ev in sdk.stream("bot", "hi", user="u"):
                got.append(ev)
    assert len(got) == 1 and e.value.code == "agent-error" and fails_midway.requests == 1
