"""Per-instance limits on their own: open connections, new connections per second (burst of twice the rate),
and the byte budget; time is a fake clock so the test asserts behaviour, not timing."""

from __future__ import annotations

import pytest

from moorage.egress import EgressLimited, Limits, Usage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_connection_rate_allows_a_burst_then_refills() -> None:
    clock = Clock()
    u = Usage(Limits(max_connections=1000, connects_per_s=5), clock)
    for _ in range(10):  # burst: twice the rate
        u.admit()
        u.release()
    with pytest.raises(EgressLimited, match="new egress connections"):
        u.admit()
    clock.now += 0.2  # one token back at 5/s
    u.admit()
    with pytest.raises(EgressLimited):
        u.admit()


def test_open_connections_are_bounded_and_released() -> None:
    u = Usage(Limits(max_connections=2, connects_per_s=100), Clock())
    u.admit()
    u.admit()
    with pytest.raises(EgressLimited, match="open egress connections"):
        u.admit()
    u.release()
    u.admit()


async def test_the_byte_budget_ends_traffic_and_refuses_new_connections() -> None:
    u = Usage(Limits(connects_per_s=100, max_bytes=1000), Clock())
    await u.spend(600)
    with pytest.raises(EgressLimited, match="budget"):
        await u.spend(600)
    with pytest.raises(EgressLimited, match="budget"):
        u.admit()


def test_past_the_rate_connections_are_spaced_out_until_the_wait_would_be_too_long() -> None:
    clock = Clock()
    u = Usage(Limits(max_connections=1000, connects_per_s=5), clock)
    for _ in range(10):  # the burst: no wait
        assert u.reserve(2.0) == 0.0
        u.release()
    # Then each connection holds its place in line: 0.2 s apart at 5/s, however many wait at once.
    waits = [u.reserve(2.0) for _ in range(10)]
    assert waits == pytest.approx([0.2 * (i + 1) for i in range(10)])
    with pytest.raises(EgressLimited, match="new egress connections"):
        u.reserve(2.0)  # its wait would be 2.2 s
    assert u.open == 10  # the refused one took no slot
    clock.now += 2.0  # the line moved on: ten connections' worth of tokens came back
    assert u.reserve(2.0) == pytest.approx(0.2)
