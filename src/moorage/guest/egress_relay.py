"""The guest end of an agent's network: its NIC brought up, or a proxy address relayed to the host over the channel.

Stdlib only. Active only in sandboxes of agents that declare ``[agent.network]`` (the host puts
``MOORAGE_NETWORK=1`` and ``HTTP(S)_PROXY`` in their environment). A micro-VM with a network device (decisions/0013)
gets ``eth0`` at a fixed address, its proxy variables pointed at the gateway on the other end of the tap and its
resolver at the gateway's DNS responder there (only names the agent's policy admits resolve). Every sandbox also keeps
the relay (and no DNS where it is the only way out): each connection to 127.0.0.1:3128 becomes a host call (``egress.open``) and its bytes
travel in frames (``egress.send``/``egress.recv``) to the host's egress gateway (decisions/0009), which decides
every request either way; nothing else leaves the sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import os
import socket
import struct
import time
from typing import Any, MutableMapping, Optional

from .rpc import METHOD_NOT_FOUND, Peer, Registry, RpcError, log

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
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCSIFADDR, _SIOCSIFNETMASK = 0x8913, 0x8914, 0x8916, 0x891C
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")


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


def point_resolver(on_nic: bool, path: str = RESOLV_CONF) -> None:
    """With a NIC, the resolver asks the gateway on the tap (written on the root disk, which is read-write in a
    VM). Without one there is no DNS: a file this module wrote before (the same disk booted where no NIC could be
    made) is removed; anyone else's is left alone."""
    if on_nic:
        tmp = path + ".moorage"
        with open(tmp, "w") as f:
            # Short timeouts: a lookup the gateway drops (its rate bound) fails fast instead of hanging the caller.
            f.write("%s\nnameserver %s\noptions timeout:2 attempts:2\n" % (RESOLV_MARK, GATEWAY_DNS))
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
            writer.close()
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


def register(registry: Registry) -> None:
    if os.environ.get("MOORAGE_NETWORK") != "1":
        return
    relay = EgressRelay(registry)

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
