"""The gateway's DNS responder: answers only for names the agent's policy admits, from the host's resolver.

Names outside the policy get NXDOMAIN without any upstream query, so a guest cannot leak data through
lookups of names it makes up; answers hold only addresses the operator's address policy allows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord

from moorage.aio import within
from moorage.egress.addresses import IPAddress
from moorage.egress.connector import InstanceEgress
from moorage.egress.resolve import NameNotFound
from moorage.egress.rules import normalize_host
from moorage.log import get_logger

log = get_logger(__name__)

TTL_S = 30


async def answer(inst: InstanceEgress, packet: bytes) -> bytes | None:
    """The reply to one DNS query packet (None for a packet that is not a query we can parse)."""
    try:
        q = DNSRecord.parse(packet)
    except Exception:  # noqa: BLE001 - dnslib raises several types on garbage; garbage gets no reply
        return None
    reply = q.reply()
    if len(q.questions) != 1:
        reply.header.rcode = RCODE.FORMERR
        return reply.pack()
    question = q.questions[0]
    started = time.time()
    try:
        name = normalize_host(str(question.qname))
    except (ValueError, UnicodeError):
        reply.header.rcode = RCODE.NXDOMAIN
        return reply.pack()
    if not any(r.host_matches(name) for r in inst.policy.rules):
        reply.header.rcode = RCODE.NXDOMAIN
        inst.span(started, "denied", **{"egress.via": "dns", "egress.host": name, "egress.decision": "no-rule"})
        return reply.pack()
    try:
        addresses: list[IPAddress] = await inst.egress.resolver.resolve(name, inst.owner)
    except NameNotFound:
        reply.header.rcode = RCODE.NXDOMAIN
        return reply.pack()
    verdicts = [inst.policy.operator.addresses.judge(ip) for ip in addresses]
    refused = next((v.category for v in verdicts if not v.allowed), None)
    if refused is not None:
        # The same rule as for connections: one internal address refuses the name.
        reply.header.rcode = RCODE.NXDOMAIN
        inst.span(started, "denied", **{"egress.via": "dns", "egress.host": name, "egress.decision": refused})
        return reply.pack()
    for ip in addresses:
        if question.qtype in (QTYPE.A, QTYPE.ANY) and ip.version == 4:
            reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(str(ip)), ttl=TTL_S))
        elif question.qtype in (QTYPE.AAAA, QTYPE.ANY) and ip.version == 6:
            reply.add_answer(RR(question.qname, QTYPE.AAAA, rdata=AAAA(str(ip)), ttl=TTL_S))
    return reply.pack()


#: Queries per second one instance's responder answers (a burst of twice this); the rest are dropped.
QUERIES_PER_S = 50.0
#: Queries one responder answers at once; more are dropped, not queued.
MAX_IN_FLIGHT = 64
#: A UDP query with one question fits in far less; a bigger datagram is not parsed. A reply over this size (without
#: EDNS, what a stub resolver takes) goes back truncated (TC set, no records), never in pieces; the resolver then
#: asks again over TCP, where a responder serves it.
MAX_UDP_BYTES = 512
#: TCP connections one responder serves at once (a resolver opens one per truncated answer); more are closed.
MAX_TCP_CONNECTIONS = 8


class Limiter:
    """Queries one responder answers: a token bucket of ``QUERIES_PER_S`` (a burst of twice that), shared by its
    UDP and TCP sides so neither is a way around the other."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens = 2 * QUERIES_PER_S
        self._last = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(2 * QUERIES_PER_S, self._tokens + (now - self._last) * QUERIES_PER_S)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, inst: InstanceEgress, limiter: Limiter) -> None:
        self.inst = inst
        self.transport: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._limiter = limiter

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) > MAX_UDP_BYTES or len(self._tasks) >= MAX_IN_FLIGHT or not self._limiter.take():
            return  # a flood of lookups is dropped, not queued
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, data: bytes, addr: Any) -> None:
        try:
            out = await answer(self.inst, data)
        except Exception as e:  # noqa: BLE001 - one bad query must not stop the responder
            log.info("dns query failed", error=type(e).__name__)
            return
        if out is not None and len(out) > MAX_UDP_BYTES:
            out = truncated(out)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


def truncated(reply: bytes) -> bytes:
    """``reply`` without its records and with TC set, its question kept: a resolver ignores a reply whose question
    is not the one it asked (dnslib's own ``truncate`` drops it), and asks again over TCP on this one."""
    r = DNSRecord.parse(reply)
    r.rr, r.auth, r.ar = [], [], []
    r.header.tc = 1
    return r.pack()


async def serve_stream(inst: InstanceEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       limiter: Limiter | None = None) -> None:
    """DNS over a stream (TCP, or the unix socket a VM's guestfwd reaches): 2-byte length, message, repeated, until
    the client closes, stays idle 30 s, sends what is not a query, or (with ``limiter``) asks past its rate."""
    try:
        while True:
            size = int.from_bytes(await within(reader.readexactly(2), 30), "big")
            query = await within(reader.readexactly(size), 30)
            if limiter is not None and not limiter.take():
                break
            out = await answer(inst, query)
            if out is None:
                break
            writer.write(len(out).to_bytes(2, "big") + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_udp(inst: InstanceEgress, host: str = "", port: int = 0, *, sock: Any = None,
                    limiter: Limiter | None = None) -> tuple[asyncio.DatagramTransport, int]:
    """Start a UDP responder for ``inst`` on ``host:port``, or on ``sock`` (a UDP socket already bound, e.g. in a
    VM's network namespace; the transport owns it); returns the transport (close it to stop) and the bound port."""
    loop = asyncio.get_running_loop()
    limiter = limiter or Limiter()
    if sock is not None:
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(inst, limiter), sock=sock)
    else:
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(inst, limiter), local_addr=(host, port))
    return transport, transport.get_extra_info("sockname")[1]


async def serve_tcp(inst: InstanceEgress, sock: Any, limiter: Limiter) -> asyncio.Server:
    """Start a TCP responder for ``inst`` on ``sock`` (a listening socket; the server owns it): at most
    ``MAX_TCP_CONNECTIONS`` at once, each query taken from ``limiter``. Close the server to stop."""
    open_conns: set[asyncio.StreamWriter] = set()

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(open_conns) >= MAX_TCP_CONNECTIONS:
            writer.close()
            return
        open_conns.add(writer)
        try:
            await serve_stream(inst, reader, writer, limiter)
        finally:
            open_conns.discard(writer)

    return await asyncio.start_server(one, sock=sock)
