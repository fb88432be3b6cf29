"""The guest end of an agent's network: its NIC brought up, or a proxy address relayed to the host over the channel.

Stdlib only. Active only in sandboxes of agents that declare ``[agent.network]`` (the host puts
``MOORAGE_NETWORK=1`` and ``HTTP(S)_PROXY`` in their environment). A micro-VM with a network device (decisions/0013)
gets ``eth0`` at a fixed address, its proxy variables pointed at the gateway on the other end of the tap and its
resolver at the gateway's DNS responder there (only names the agent's policy admits resolve). Every sandbox also keeps
the relay: each connection to 127.0.0.1:3128 becomes a host call (``egress.open``) and its bytes
travel in frames (``egress.send``/``egress.recv``) to the host's egress gateway (decisions/0009), which decides
every request either way; nothing else leaves the sandbox. Where the relay is the only way out, the resolver asks
127.0.0.1:53: in a micro-VM this module listens there (UDP and TCP) and hands each query to the host
(``egress.dns``), whose gateway responder answers it; in a process sandbox (where nothing inside may bind port 53)
the host binds that address itself (sandbox/process_net.py) and this module leaves it alone.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import os
import socket
import struct
import time
from typing import Any, MutableMapping, Optional

from .rpc import BUSY, METHOD_NOT_FOUND, Peer, Registry, RpcError, log

PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128
CHUNK = 256 * 1024
#: How long a new connection waits for the host to be connected and serving egress (a wake, a first turn).
ATTACH_WAIT_S = 15.0
#: The NIC's side of the host's namespace (the same in every VM and after every wake; sandbox/microvm_net.py).
NIC_NAME = "eth0"
NIC_MAC = "52:54:00:6d:6f:0f"
NIC_ADDRESS = "10.0.2.15"
NIC_NETMASK = "255.255.255.0"
GATEWAY_PROXY = "http://10.0.2.2:3128"
GATEWAY_DNS = "10.0.2.2"
RESOLV_CONF = "/etc/resolv.conf"
#: The first line of a resolv.conf this module wrote (and so may replace or remove).
RESOLV_MARK = "# moorage: the egress gateway's DNS (decisions/0013)"
#: Where the relay's DNS listens (the resolver's address when the relay is the way out; docs/egress.md).
DNS_HOST = "127.0.0.1"
DNS_PORT = 53
#: A query bigger than a UDP query may be is dropped here (one question fits in far less), as the host would refuse it.
MAX_DNS_QUERY = 512
#: Queries relayed at once (more are dropped, not queued: the resolver asks again), and TCP connections served at once.
DNS_IN_FLIGHT = 32
DNS_TCP_CONNECTIONS = 8
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCSIFADDR, _SIOCSIFNETMASK = 0x8913, 0x8914, 0x8916, 0x891C
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
#: How long a refused client's request head is read for, and its answer given, before the connection is closed.
REFUSE_READ_S = 5.0
_PHRASES = {403: "Forbidden", 429: "Too Many Requests", 503: "Service Unavailable"}


def _ifreq(name: str, payload: bytes = b"") -> bytes:
    return struct.pack("16s24s", name.encode(), payload)


def _addr(ip: str) -> bytes:
    return struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip))


def bring_up_nic(name: str = NIC_NAME) -> bool:
    """Give the VM's virtio-net device its fixed address and bring it up. False when there is none (no NIC: the
    relay is the network). Only the on-link route exists: there is no gateway to route anything else to."""
    try:
        with open("/sys/class/net/%s/address" % name) as f:
            # Only the device the host made for this (its fixed address): never some other interface by that name.
            if f.read().strip() != NIC_MAC:
                return False
    except OSError:
        return False
    try:  # IPv4 only: no link-local IPv6 address, no neighbour discovery on the tap
        with open("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % name, "w") as f:
            f.write("1")
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ctl:
        fcntl.ioctl(ctl, _SIOCSIFADDR, _ifreq(name, _addr(NIC_ADDRESS)))
        fcntl.ioctl(ctl, _SIOCSIFNETMASK, _ifreq(name, _addr(NIC_NETMASK)))
        flags = struct.unpack("16sH22x", fcntl.ioctl(ctl, _SIOCGIFFLAGS, _ifreq(name)))[1]
        fcntl.ioctl(ctl, _SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags | 0x1)))
    return True


def point_resolver(on_nic: bool, path: str = RESOLV_CONF, relayed: bool = False) -> None:
    """With a NIC, the resolver asks the gateway on the tap (written on the root disk, which is read-write in a
    VM); with ``relayed``, the relay's own DNS listener on the VM's loopback. Otherwise a file this module wrote
    before (the same disk booted with a NIC, or a network since removed) is removed; anyone else's is left alone."""
    if on_nic or relayed:
        tmp = path + ".moorage"
        with open(tmp, "w") as f:
            # Short timeouts: a lookup the gateway drops (its rate bound) fails fast instead of hanging the caller.
            f.write("%s\nnameserver %s\noptions timeout:2 attempts:2\n"
                    % (RESOLV_MARK, GATEWAY_DNS if on_nic else DNS_HOST))
        os.replace(tmp, path)  # replaces a symlink itself, never writes through it
        return
    try:
        with open(path) as f:
            ours = f.readline().rstrip("\n") == RESOLV_MARK
    except OSError:
        return
    if ours:
        os.unlink(path)


def configure(environ: MutableMapping[str, str]) -> str:
    """Called by the supervisor before it starts anything: a network agent's VM with a NIC uses it, and every
    process started from here on gets the gateway as its proxy. Returns "nic", "relay" or "none"."""
    if environ.get("MOORAGE_NETWORK") != "1":
        try:
            point_resolver(False)
        except OSError as e:
            log("resolver not configured", error=str(e))
        return "none"
    try:
        has_nic = bring_up_nic()
    except OSError as e:
        log("network device unusable; using the relay", error=str(e))
        has_nic = False
    try:
        point_resolver(has_nic)
    except OSError as e:
        log("resolver not configured", error=str(e))
    if not has_nic:
        return "relay"
    for var in _PROXY_VARS:
        if var in environ:
            environ[var] = GATEWAY_PROXY
    environ["MOORAGE_EGRESS"] = "nic"
    log("network device up", address=NIC_ADDRESS)
    return "nic"


class EgressRelay:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def _peer(self) -> Optional[Peer]:
        for peer in list(getattr(self.registry, "peers", ()) or ()):
            if not peer.closed:
                return peer
        return None

    async def _open(self) -> "tuple[Peer, int]":
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            peer = self._peer()
            if peer is not None:
                try:
                    opened = await peer.call("egress.open", {}, timeout=30)
                    return peer, int(opened["conn"])
                except RpcError as e:
                    # The host registers its egress handlers when it first serves this sandbox after a wake.
                    if e.code != METHOD_NOT_FOUND or time.monotonic() > deadline:
                        raise
            elif time.monotonic() > deadline:
                raise RpcError("the host is not connected")
            await asyncio.sleep(0.1)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer, conn = await self._open()
        except (RpcError, asyncio.TimeoutError, OSError) as e:
            log("egress connection refused", error=str(e)[:200])
            await refuse(reader, writer, *_refusal(e))
            return

        async def up() -> None:
            while True:
                data = await reader.read(CHUNK)
                await peer.call("egress.send", {"conn": conn, "data": base64.b64encode(data).decode(), "eof": not data},
                                timeout=60)
                if not data:
                    return

        async def down() -> None:
            while True:
                got = await peer.call("egress.recv", {"conn": conn, "max": CHUNK}, timeout=60)
                data = base64.b64decode(got.get("data") or "")
                if data:
                    writer.write(data)
                    await writer.drain()
                if got.get("eof"):
                    return

        sending = asyncio.ensure_future(up())
        try:
            await down()
        except (RpcError, asyncio.TimeoutError, OSError, ValueError):
            pass
        finally:
            sending.cancel()
            try:
                await peer.call("egress.close", {"conn": conn}, timeout=10)
            except (RpcError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
            writer.close()


def _refusal(e: BaseException) -> "tuple[int, str]":
    """The HTTP status and reason a client of the proxy address gets when the host opened no connection for it."""
    data = getattr(e, "data", None)
    if isinstance(data, dict) and data.get("status") in _PHRASES:  # the host's own: no network, a limit
        return int(data["status"]), str(e)
    code = getattr(e, "code", None)
    if code == BUSY:
        return 503, "the host is serving as many of this sandbox's calls as it takes; retry"
    if code == METHOD_NOT_FOUND:
        return 503, "the host serves no network to this sandbox (the agent declares no [agent.network])"
    if isinstance(e, asyncio.TimeoutError):
        return 503, "the host did not answer in time"
    return 503, str(e) or type(e).__name__


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """Answer the client's request (read to the end of its head first, within bounds) with ``status`` and the reason
    as plain text, then close: ``curl`` and ``pip`` then say why, where a bare close said "empty reply"."""
    try:
        async with asyncio.timeout(REFUSE_READ_S):
            await reader.readuntil(b"\r\n\r\n")
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
        pass  # not the head of a request, or not all of it: answered all the same
    body = ("moorage egress relay: %s\n" % reason).encode()
    retry = "Retry-After: 1\r\n" if status == 429 else ""
    head = ("HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%sConnection: close"
            "\r\n\r\n" % (status, _PHRASES.get(status, "Error"), len(body), retry))
    try:
        writer.write(head.encode() + body)
        async with asyncio.timeout(REFUSE_READ_S):
            await writer.drain()
    except (asyncio.TimeoutError, OSError):
        pass
    finally:
        writer.close()


class DnsRelay:
    """The resolver's address where the relay is the way out (a micro-VM without a NIC): each query, over UDP or
    TCP, becomes one host call (``egress.dns``) that the gateway's responder answers under the agent's policy (only
    names it admits; NXDOMAIN without an upstream query otherwise; its rate bound). Queries past
    ``DNS_IN_FLIGHT`` or the host's bound get no answer (the resolver asks again, or gives up), as over a NIC."""

    def __init__(self, relay: EgressRelay) -> None:
        self.relay = relay
        self.in_flight = 0
        self.tcp_conns = 0

    def take(self, query: bytes) -> bool:
        if len(query) > MAX_DNS_QUERY or self.in_flight >= DNS_IN_FLIGHT:
            return False
        self.in_flight += 1
        return True

    async def ask(self, query: bytes, udp: bool) -> Optional[bytes]:
        """The host's answer to ``query`` (taken with ``take``), or None: dropped, or the host not serving it."""
        try:
            # Past this a resolver has given up on the query (2 s a try): a wake's first lookups wait for the host to
            # attach the network, later ones are not kept waiting.
            deadline = time.monotonic() + 4.0
            while True:
                peer = self.relay._peer()
                if peer is not None:
                    try:
                        got = await peer.call("egress.dns", {"query": base64.b64encode(query).decode(), "udp": udp},
                                              timeout=5)
                        out = got.get("answer") if isinstance(got, dict) else None
                        return base64.b64decode(out) if isinstance(out, str) and out else None
                    except RpcError as e:
                        if e.code != METHOD_NOT_FOUND or time.monotonic() > deadline:
                            return None
                elif time.monotonic() > deadline:
                    return None
                await asyncio.sleep(0.1)
        except (asyncio.TimeoutError, OSError, ValueError):
            return None
        finally:
            self.in_flight -= 1

    async def serve_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """DNS over TCP (2-byte length, message, repeated) until the client closes, idles 30 s or is not answered."""
        if self.tcp_conns >= DNS_TCP_CONNECTIONS:
            writer.close()
            return
        self.tcp_conns += 1
        try:
            while True:
                async with asyncio.timeout(30):
                    size = int.from_bytes(await reader.readexactly(2), "big")
                if size > MAX_DNS_QUERY:
                    break
                async with asyncio.timeout(30):
                    query = await reader.readexactly(size)
                if not self.take(query):
                    break
                out = await self.ask(query, udp=False)
                if out is None:
                    break
                writer.write(len(out).to_bytes(2, "big") + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
            pass
        finally:
            self.tcp_conns -= 1
            writer.close()


class _DnsDatagrams(asyncio.DatagramProtocol):
    def __init__(self, dns: DnsRelay) -> None:
        self.dns = dns
        self.transport: Any = None
        self._tasks: "set[asyncio.Future[None]]" = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if not self.dns.take(data):
            return  # a flood is dropped here, not queued
        task = asyncio.ensure_future(self._one(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, data: bytes, addr: Any) -> None:
        out = await self.dns.ask(data, udp=True)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


async def listen_dns(relay: EgressRelay) -> None:
    """The relay's DNS on 127.0.0.1:53 (UDP and TCP) and the resolver pointed at it, where the guest may bind port
    53 (a micro-VM's root). A process sandbox may not (and needs not: the host serves that address there)."""
    loop = asyncio.get_running_loop()
    dns = DnsRelay(relay)
    try:
        transport, _ = await loop.create_datagram_endpoint(lambda: _DnsDatagrams(dns), local_addr=(DNS_HOST, DNS_PORT))
    except OSError as e:
        if e.errno != errno.EACCES:
            log("DNS address unavailable", error=str(e))
        return
    try:
        server = await asyncio.start_server(dns.serve_stream, DNS_HOST, DNS_PORT)
    except OSError as e:
        log("DNS address unavailable", error=str(e))
        transport.close()
        return
    try:
        point_resolver(False, relayed=True)
    except OSError as e:
        log("resolver not configured", error=str(e))
    log("DNS relay listening", port=DNS_PORT)
    try:
        async with server:
            await server.serve_forever()
    finally:
        transport.close()


def register(registry: Registry) -> None:
    if os.environ.get("MOORAGE_NETWORK") != "1":
        return
    relay = EgressRelay(registry)
    # The agent's own network (``MOORAGE_NIC``, which the host sets for [agent.network] only; a template's relay for
    # deploy-time installs has none), where no NIC carries the gateway's DNS.
    if os.environ.get("MOORAGE_NIC") == "1" and os.environ.get("MOORAGE_EGRESS") != "nic":
        registry.dns_listener = asyncio.get_running_loop().create_task(listen_dns(relay))  # type: ignore[attr-defined]

    async def listen() -> None:
        try:
            server = await asyncio.start_server(relay.handle, PROXY_HOST, PROXY_PORT)
        except OSError as e:
            log("egress proxy address unavailable", error=str(e))
            return
        log("egress proxy listening", port=PROXY_PORT)
        async with server:
            await server.serve_forever()

    registry.egress_listener = asyncio.get_running_loop().create_task(listen())  # type: ignore[attr-defined]
