"""A channel's share of the host (sandbox/channel_share.py): the loop-thread CPU its guest causes (frames decoded,
the steps of the calls it makes) is charged to the channel's share, and while the share is spent the channel reads
nothing more from that guest."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest

from moorage.runtime.cpu_share import Meter
from moorage.sandbox.channel import Channel
from moorage.sandbox.channel_share import Charged


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


class Tally:
    def __init__(self) -> None:
        self.charged = 0.0

    def charge(self, seconds: float) -> None:
        self.charged += seconds

    def wait_s(self) -> float:
        return 0.0


async def test_charged_counts_the_steps_of_a_coroutine_not_its_waits() -> None:
    tally = Tally()

    async def work() -> str:
        _burn(0.03)
        await asyncio.sleep(0.2)  # suspended: not CPU of this coroutine
        _burn(0.02)
        return "done"

    assert await Charged(work(), tally) == "done"
    assert 0.05 <= tally.charged < 0.1, tally.charged


async def test_charged_passes_errors_and_cancellation_through() -> None:
    tally = Tally()
    cleaned = asyncio.Event()

    async def fails() -> None:
        _burn(0.01)
        raise KeyError("x")

    with pytest.raises(KeyError):
        await Charged(fails(), tally)
    assert tally.charged >= 0.01

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            _burn(0.01)
            cleaned.set()

    async def outer() -> None:
        await Charged(waits(), tally)

    before = tally.charged
    task = asyncio.get_running_loop().create_task(outer())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set() and tally.charged - before >= 0.01  # the cancelled coroutine's cleanup ran, charged


async def test_a_guest_past_its_share_is_not_read_until_the_share_refills() -> None:
    """Each request costs the host 5 ms of loop CPU; at a share of 0.2 cores and no burst, 30 of them (0.15 s of
    CPU) cannot be served in less than ~0.75 s, where unshared they take ~0.15 s. The requests are all answered."""
    host_sock, guest_sock = socket.socketpair()
    r, w = await asyncio.open_connection(sock=host_sock)
    ch = Channel(r, w, name="share")
    meter = Meter(0.2, burst_s=0.0)
    ch.share = meter

    async def costly(params: object, ctx: object) -> str:
        _burn(0.005)
        return "ok"

    ch.register("costly", costly)
    ch.start()
    gr, gw = await asyncio.open_connection(sock=guest_sock)
    try:
        started = time.perf_counter()
        for i in range(30):
            p = json.dumps({"id": i, "method": "costly", "params": {}}).encode()
            gw.write(struct.pack(">I", len(p)) + p)
        await gw.drain()
        answers = []
        for _ in range(30):
            (n,) = struct.unpack(">I", await gr.readexactly(4))
            answers.append(json.loads(await gr.readexactly(n)))
        elapsed = time.perf_counter() - started
        assert sorted(a["id"] for a in answers) == list(range(30)) and all(a["result"] == "ok" for a in answers)
        assert meter.used_s >= 0.15  # the handlers' loop CPU, charged by the channel
        assert meter.waits > 0
        assert elapsed >= 0.6, elapsed
    finally:
        await ch.close()
        gw.close()


async def test_frames_a_guest_sends_are_charged_to_its_share() -> None:
    """Not only calls: events and answers cost the host their decoding, charged too."""
    host_sock, guest_sock = socket.socketpair()
    r, w = await asyncio.open_connection(sock=host_sock)
    ch = Channel(r, w, name="frames")
    meter = Meter(100.0)
    ch.share = meter
    ch.start()
    gr, gw = await asyncio.open_connection(sock=guest_sock)
    try:
        stream = ch.stream("produce")
        await stream._begin()
        (n,) = struct.unpack(">I", await gr.readexactly(4))
        rid = json.loads(await gr.readexactly(n))["id"]
        for i in range(500):
            p = json.dumps({"id": rid, "event": "tick", "data": {"i": i, "pad": "x" * 4000}}).encode()
            gw.write(struct.pack(">I", len(p)) + p)
        done = json.dumps({"id": rid, "result": "done"}).encode()
        gw.write(struct.pack(">I", len(done)) + done)
        await gw.drain()
        assert len([ev async for ev in stream]) == 500
        assert meter.used_s > 0
    finally:
        await ch.close()
        gw.close()
