"""Property-based fuzz of the host side of the channel: whatever bytes a guest sends, the host never crashes,
never hangs, and keeps serving a well-behaved request afterwards (or drops the connection cleanly).

The "guest" here is the raw other end of a socketpair, so every frame is exactly what the strategy produced.
"""

from __future__ import annotations

import asyncio
import json
import time
import socket
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moorage.sandbox.base import GuestProtocolError
from moorage.sandbox.channel import MAX_DEPTH, Channel, HandlerContext

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 10  # a small limit so "too large" frames are cheap to make
#: No single example may take longer than this: a hang fails the test instead of stalling it.
EXAMPLE_TIMEOUT_S = 10.0

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=10), kids, max_size=5)), max_leaves=30)
ids = st.one_of(st.none(), st.integers(min_value=-5, max_value=2**64), st.text(max_size=8), st.booleans(),
                st.lists(st.integers(), max_size=2), st.floats(allow_nan=False))
methods = st.one_of(st.sampled_from(["echo", "slow", "$cancel", "nope", ""]), st.text(max_size=12), st.integers())

# Frames shaped like protocol messages, each field possibly of the wrong type.
messages = st.one_of(
    st.fixed_dictionaries({"id": ids, "method": methods}, optional={"params": json_values}),
    st.fixed_dictionaries({"method": st.just("$cancel"), "params": json_values}),
    st.fixed_dictionaries({"id": ids, "event": st.one_of(st.text(max_size=8), st.integers())},
                          optional={"data": json_values}),
    st.fixed_dictionaries({"id": ids, "result": json_values}),
    st.fixed_dictionaries({"id": ids, "error": st.one_of(json_values, st.fixed_dictionaries(
        {"code": st.one_of(st.integers(), st.text(max_size=5)), "message": json_values}, optional={"data": json_values}))}),
    json_values,
)


def nested(depth: int, kind: str) -> bytes:
    return (kind[0] * depth + kind[1] * depth).encode() if kind == "[]" else (b'{"a":' * depth + b"1" + b"}" * depth)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def _pair() -> tuple[Channel, asyncio.StreamReader, asyncio.StreamWriter]:
    host_sock, guest_sock = socket.socketpair()
    r, w = await asyncio.open_connection(sock=host_sock)
    ch = Channel(r, w, name="fuzz", max_frame=MAX_FRAME, max_guest_inflight=4)

    async def echo(params: Any, ctx: HandlerContext) -> Any:
        return params

    async def slow(params: Any, ctx: HandlerContext) -> Any:
        await asyncio.sleep(0.05)
        return "slow"

    ch.register("echo", echo)
    ch.register("slow", slow)
    ch.start()
    gr, gw = await asyncio.open_connection(sock=guest_sock)
    return ch, gr, gw


async def _answer_to(gr: asyncio.StreamReader, rid: Any) -> dict[str, Any]:
    """Read host frames until the response to ``rid`` (events and answers to fuzzed requests are skipped)."""
    while True:
        (n,) = HEADER.unpack(await gr.readexactly(4))
        msg = json.loads(await gr.readexactly(n))
        if isinstance(msg, dict) and msg.get("id") == rid and ("result" in msg or "error" in msg):
            return msg


async def _still_serves(ch: Channel, gr: asyncio.StreamReader, gw: asyncio.StreamWriter) -> None:
    assert not ch.closed, ch._close_reason
    assert ch._read_task is not None and not ch._read_task.done()
    gw.write(frame(json.dumps({"id": "probe-after-fuzz", "method": "echo", "params": {"ok": 1}}).encode()))
    await gw.drain()
    answer = await _answer_to(gr, "probe-after-fuzz")
    # The probe may be refused as busy if fuzzed "slow" calls still run; it is never lost or misrouted.
    assert answer.get("result") == {"ok": 1} or answer["error"]["code"] == -32002, answer


def run(coro: Any) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, EXAMPLE_TIMEOUT_S)

    asyncio.run(bounded())


@SETTINGS
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8))
def test_random_payloads_are_rejected_and_the_channel_keeps_serving(payloads: list[bytes]) -> None:
    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            for p in payloads:
                gw.write(frame(p))
            await gw.drain()
            await _still_serves(ch, gr, gw)
        finally:
            await ch.close()
            gw.close()

    run(body())


@SETTINGS
@given(st.lists(messages, min_size=1, max_size=12))
def test_adversarial_messages_never_crash_the_host(msgs: list[Any]) -> None:
    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            for m in msgs:
                data = json.dumps(m).encode()
                if len(data) <= MAX_FRAME:
                    gw.write(frame(data))
            await gw.drain()
            await _still_serves(ch, gr, gw)
        finally:
            await ch.close()
            gw.close()

    run(body())


@SETTINGS
@given(st.integers(min_value=MAX_DEPTH + 1, max_value=20_000), st.sampled_from(["[]", "{}"]),
       st.sampled_from(["bare", "in-params", "in-result"]))
def test_deeply_nested_frames_are_protocol_errors(depth: int, kind: str, where: str) -> None:
    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            deep = nested(depth, kind)
            if where == "in-params":
                deep = b'{"id":1,"method":"echo","params":' + deep + b"}"
            elif where == "in-result":
                deep = b'{"id":1,"result":' + deep + b"}"
            if len(deep) > MAX_FRAME:
                deep = deep[: MAX_FRAME]  # cut: then it is invalid JSON, also a protocol error
            before = ch.rejected_frames
            gw.write(frame(deep))
            await gw.drain()
            await _still_serves(ch, gr, gw)
            assert ch.rejected_frames == before + 1
        finally:
            await ch.close()
            gw.close()

    run(body())


@SETTINGS
@given(st.one_of(st.just(0), st.integers(min_value=MAX_FRAME + 1, max_value=2**32 - 1)),
       st.binary(max_size=64))
def test_bad_lengths_close_the_connection_cleanly_without_reading_the_body(length: int, tail: bytes) -> None:
    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            pending = asyncio.ensure_future(ch.call("ping", timeout=None))
            await asyncio.sleep(0)
            gw.write(HEADER.pack(length) + tail)
            await gw.drain()
            await ch.wait_closed()
            try:
                await pending
                raise AssertionError("a call survived a protocol error")
            except GuestProtocolError as e:
                assert str(length) in str(e)
        finally:
            await ch.close()
            gw.close()

    run(body())


@SETTINGS
@given(st.binary(min_size=1, max_size=200), st.integers(min_value=1, max_value=3))
def test_truncated_frames_end_the_connection_cleanly(payload: bytes, cut: int) -> None:
    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            data = frame(payload)
            gw.write(data[: max(len(data) - cut, 1)])
            await gw.drain()
            gw.close()
            await ch.wait_closed()
            assert ch.closed
        finally:
            await ch.close()

    run(body())


def test_event_flood_gets_backpressure_and_a_reader_that_stops_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from moorage.sandbox import channel as channel_mod

    monkeypatch.setattr(channel_mod, "EVENT_STALL_S", 0.5)
    # Backpressure, not the reader's frame rate (test_fairness.py), is what this tests: the rate is not in the way.
    monkeypatch.setattr(channel_mod, "READ_FRAMES_PER_S", 1 << 30)
    monkeypatch.setattr(channel_mod, "READ_BURST_FRAMES", 1 << 30)
    total = channel_mod.MAX_PENDING_EVENTS * 3

    async def body() -> None:
        ch, gr, gw = await _pair()
        try:
            async def guest_streams(rid: Any) -> None:
                for i in range(total):
                    gw.write(frame(json.dumps({"id": rid, "event": "tick", "data": i}).encode()))
                    if i % 256 == 0:
                        await gw.drain()
                gw.write(frame(json.dumps({"id": rid, "result": "done"}).encode()))
                await gw.drain()

            async def next_request_id() -> Any:
                while True:
                    (n,) = HEADER.unpack(await gr.readexactly(4))
                    msg = json.loads(await gr.readexactly(n))
                    if "method" in msg and msg["method"] != "$cancel":
                        return msg["id"]

            # A slow but steady reader gets every event: the guest waits instead of the host buffering.
            async with ch.stream("produce") as s:
                writer = asyncio.ensure_future(guest_streams(await next_request_id()))
                got, peak = 0, 0
                async for _ in s:
                    got += 1
                    peak = max(peak, s._pending.events.qsize())  # type: ignore[union-attr]
                    if got % 1000 == 0:
                        await asyncio.sleep(0.01)
                await writer
            assert got == total and s.result == "done"
            assert peak <= channel_mod.MAX_PENDING_EVENTS
            # A caller that stops reading for longer than the stall time: its call fails, the channel lives on.
            async with ch.stream("produce") as s2:
                writer = asyncio.ensure_future(guest_streams(await next_request_id()))
                seen = 0
                with pytest.raises(GuestProtocolError):
                    async for _ in s2:
                        seen += 1
                        if seen == 1:
                            # The stall counts once the host's buffer is full (backpressure): on a loaded host the
                            # guest may take longer than the pause to fill it (CI run of stop 43), so wait for it.
                            full_by = time.monotonic() + 30
                            while s2._pending.events.qsize() < channel_mod.MAX_PENDING_EVENTS \
                                    and time.monotonic() < full_by:  # type: ignore[union-attr]
                                await asyncio.sleep(0.05)
                            await asyncio.sleep(1.5)
                assert seen <= channel_mod.MAX_PENDING_EVENTS + 1
                writer.cancel()
            assert not ch.closed
        finally:
            await ch.close()
            gw.close()

    run(body())
