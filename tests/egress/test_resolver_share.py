"""The host's resolver under a guest that asks for names whose servers never answer. Its lookups run on the resolver's
own threads, a few per tenant, never on asyncio's default executor (where every tenant's store hops run): the flood
holds its own tenant's lookups, not the host, and another tenant's names still resolve at once.

The C library's resolver is the real one; only the names under ``slow.test`` block, standing in for an upstream
server that never answers (the machine has no DNS server to make slow)."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from typing import Any, Iterator

import pytest
from dnslib import RCODE, DNSRecord

from moorage.egress import Egress, NameNotFound, SystemResolver
from moorage.egress.dns import answer
from moorage.egress.resolve import LOOKUPS_PER_OWNER
from tests.egress.conftest import TEST_OPERATOR

pytestmark = pytest.mark.asyncio


class Blackhole:
    """``socket.getaddrinfo`` whose names under slow.test hang until released (counting those hanging at once);
    every other name goes to the real one."""

    def __init__(self) -> None:
        self.real = socket.getaddrinfo
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.hanging = 0
        self.most = 0

    def __call__(self, host: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(host, str) and host.endswith("slow.test"):
            with self.lock:
                self.hanging += 1
                self.most = max(self.most, self.hanging)
            try:
                self.release.wait(30)
            finally:
                with self.lock:
                    self.hanging -= 1
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return self.real(host, *a, **kw)


@pytest.fixture
def blackhole(monkeypatch: pytest.MonkeyPatch) -> Iterator[Blackhole]:
    hole = Blackhole()
    monkeypatch.setattr(socket, "getaddrinfo", hole)
    yield hole
    hole.release.set()


def _query(name: str) -> bytes:
    return DNSRecord.question(name, "A").pack()


async def test_a_flood_of_hanging_names_leaves_the_host_and_other_tenants_alone(blackhole: Blackhole) -> None:
    egress = Egress(TEST_OPERATOR, SystemResolver(timeout_s=1.0))
    attacker = egress.instance({"egress": {"allow": ["https://*.slow.test"]}}, owner="tenant-a")
    # The attacking guest's responder takes up to 64 queries at once (egress.dns.MAX_IN_FLIGHT), each a new name.
    flood = [asyncio.create_task(answer(attacker, _query(f"n{i}.slow.test"))) for i in range(64)]
    await asyncio.sleep(0.2)
    try:
        # Asyncio's default executor (every tenant's store hops) is free: a hop runs at once.
        t0 = time.monotonic()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "hop"), 3.0) == "hop"
        hop_s = time.monotonic() - t0
        assert hop_s < 0.5, f"a store hop waited {hop_s:.2f} s behind the flood's lookups"
        # Another tenant's name resolves at once (the real resolver: localhost, from /etc/hosts).
        t0 = time.monotonic()
        found = await asyncio.wait_for(egress.resolver.resolve("localhost", "tenant-b"), 3.0)
        assert found and time.monotonic() - t0 < 0.5
        # The flood holds no more than its tenant's share of the resolver's threads.
        assert blackhole.most <= LOOKUPS_PER_OWNER, blackhole.most
        replies = [DNSRecord.parse(r) for r in await asyncio.gather(*flood) if r is not None]
    finally:
        blackhole.release.set()
    # Every flooded name failed as "not found" within the timeout (none answered, none hung the responder).
    assert len(replies) == 64 and {r.header.rcode for r in replies} == {RCODE.NXDOMAIN}


async def test_a_tenant_gets_its_lookups_back_when_the_hanging_ones_end(blackhole: Blackhole) -> None:
    resolver = SystemResolver(timeout_s=0.3)
    hung = [asyncio.create_task(resolver.resolve(f"h{i}.slow.test", "tenant-a")) for i in range(LOOKUPS_PER_OWNER)]
    for task in hung:
        with pytest.raises(NameNotFound):
            await task
    # Given up on, but their threads still wait on the C library: the slots are still held until those end.
    assert blackhole.hanging == LOOKUPS_PER_OWNER
    with pytest.raises(NameNotFound):
        await resolver.resolve("localhost", "tenant-a")
    assert (await resolver.resolve("localhost", "tenant-b"))  # another tenant is not held up by them
    blackhole.release.set()
    for _ in range(100):
        if blackhole.hanging == 0:
            break
        await asyncio.sleep(0.02)
    assert await resolver.resolve("localhost", "tenant-a")
    assert resolver.slots.busy == {} and resolver.slots.waiters == {}


async def test_a_waiting_lookup_takes_the_slot_a_finished_one_frees(blackhole: Blackhole) -> None:
    resolver = SystemResolver(timeout_s=3.0, per_owner=1)
    hung = asyncio.create_task(resolver.resolve("one.slow.test", "t"))
    await asyncio.sleep(0.1)
    waiting = asyncio.create_task(resolver.resolve("localhost", "t"))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    blackhole.release.set()
    with pytest.raises(NameNotFound):
        await hung
    assert await asyncio.wait_for(waiting, 2.0)


async def test_the_responder_over_the_channel_uses_the_tenants_share(blackhole: Blackhole) -> None:
    """The micro-VM relay's ``egress.dns`` call reaches the same responder with the instance's owner."""
    from moorage.runtime.vm_network import _Relay

    egress = Egress(TEST_OPERATOR, SystemResolver(timeout_s=0.5))
    relay = _Relay(egress.instance({"egress": {"allow": ["https://*.slow.test"]}}, owner="tenant-a"))
    calls = [relay.dns({"query": base64.b64encode(_query(f"c{i}.slow.test")).decode()}, None) for i in range(20)]
    try:
        out = await asyncio.gather(*calls)
    finally:
        blackhole.release.set()
    assert blackhole.most <= LOOKUPS_PER_OWNER
    assert all(DNSRecord.parse(base64.b64decode(o["answer"])).header.rcode == RCODE.NXDOMAIN
               for o in out if o["answer"] is not None)
