"""An agent's own network: the host end of its VM's NIC, or of the proxy relay inside its sandbox.

Agents that declare ``[agent.network]`` get ``HTTP(S)_PROXY`` pointing at the egress gateway's proxy
(``egress.proxy.serve_connection``, under the agent's policy, limits, spans and secret headers). On a micro-VM with
a NIC (decisions/0013) the proxy listens on the tap's address inside the VM's own network namespace, which holds
nothing else, and so does the gateway's DNS responder (``egress.dns``: only names the policy admits); elsewhere each
connection to the sandbox's relay arrives over the host↔guest channel (decisions/0009), and a process sandbox's
resolver asks the same responder on 127.0.0.1:53 of its own namespace, where the host bound it (``process_net``). Either way a connection that skips the proxy has nowhere to go.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import socket
import uuid
from typing import Any, Mapping

from moorage.aio import within
from moorage.log import get_logger
from moorage.sandbox import microvm_net, process_net
from moorage.sandbox.channel import HandlerError

log = get_logger(__name__)

#: What the guest's relay calls on the host.
_METHODS = ("egress.open", "egress.send", "egress.recv", "egress.close", "egress.dns")
#: Where the guest's relay listens; what HTTP_PROXY/HTTPS_PROXY name inside the sandbox.
PROXY_URL = "http://127.0.0.1:3128"
#: Connections one sandbox may have open through its relay (the gateway's own limits apply as well).
MAX_CONNECTIONS = 16
CHUNK = 256 * 1024
#: Longest one ``egress.recv`` waits for bytes before answering with none (the guest asks again).
RECV_WAIT_S = 25.0
#: The largest DNS query ``egress.dns`` takes (a UDP query's bound; one question fits in far less), and its base64.
MAX_DNS_QUERY = 512
_MAX_DNS_QUERY_B64 = 4 * ((MAX_DNS_QUERY + 2) // 3)


def has_network(manifest: Mapping[str, Any]) -> bool:
    return isinstance(manifest.get("network"), dict)


def guest_env(manifest: Mapping[str, Any]) -> dict[str, str]:
    """The environment a network agent's sandbox gets: its relay on, and every proxy-aware tool pointed at it.
    The sandbox's own loopback stays direct (its app, its own servers)."""
    if not has_network(manifest):
        return {}
    no_proxy = "localhost,127.0.0.1,::1"
    # MOORAGE_NIC asks the micro-VM driver for a NIC (it makes one where the host can); the guest points the proxy
    # variables at the gateway behind it when it finds the device, and keeps the relay's address otherwise.
    return {"MOORAGE_NETWORK": "1", microvm_net.WANT_ENV: "1", "HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL, "http_proxy": PROXY_URL,
            "https_proxy": PROXY_URL, "NO_PROXY": no_proxy, "no_proxy": no_proxy}


class _Relay:
    """One sandbox's relayed connections, each a socket pair whose far end the gateway's proxy serves."""

    def __init__(self, inst: Any) -> None:
        self.inst = inst
        self.conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None]]] = {}
        self.ids = itertools.count(1)
        #: The proxy and the DNS responder served on the VM's NIC (decisions/0013), when it has one.
        self.nic_server: asyncio.Task[None] | None = None
        self.nic_dns: asyncio.Task[None] | None = None
        #: One rate for every way this sandbox's lookups arrive (the NIC's or the sandbox's DNS address, ``egress.dns``).
        from moorage.egress.dns import Limiter

        self.dns_limiter = Limiter()
        self.dns_in_flight = 0

    def _conn(self, params: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, "asyncio.Task[None]"]:
        conn = self.conns.get(params.get("conn")) if isinstance(params, dict) else None
        if conn is None:
            raise HandlerError("no such connection", code=-32602)
        return conn

    async def open(self, params: Any, ctx: Any) -> dict[str, Any]:
        from moorage.egress.proxy import serve_connection

        if len(self.conns) >= MAX_CONNECTIONS:
            # The guest's relay answers its client 429 with this (guest/egress_relay.py).
            raise HandlerError(f"at most {MAX_CONNECTIONS} connections at once through this sandbox's relay",
                               code=-32000, data={"status": 429})
        near, far = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=near)
        p_reader, p_writer = await asyncio.open_connection(sock=far)
        task = asyncio.ensure_future(serve_connection(self.inst, p_reader, p_writer))
        cid = next(self.ids)
        self.conns[cid] = (reader, writer, task)
        return {"conn": cid}

    async def send(self, params: Any, ctx: Any) -> dict[str, Any]:
        _, writer, _ = self._conn(params)
        try:
            data = base64.b64decode(params.get("data") or "", validate=True)
        except ValueError:
            raise HandlerError("data must be base64", code=-32602) from None
        try:
            if data:
                writer.write(data)
                await writer.drain()
            if params.get("eof") and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            raise HandlerError("the connection is closed", code=-32000) from None
        return {}

    async def recv(self, params: Any, ctx: Any) -> dict[str, Any]:
        reader, _, _ = self._conn(params)
        want = params.get("max", CHUNK)
        want = CHUNK if not isinstance(want, int) or isinstance(want, bool) or want < 1 else min(want, CHUNK)
        try:
            data = await within(reader.read(want), RECV_WAIT_S)
        except asyncio.TimeoutError:
            return {"data": "", "eof": False}
        except (ConnectionError, OSError):
            data = b""
        return {"data": base64.b64encode(data).decode(), "eof": not data}

    async def dns(self, params: Any, ctx: Any) -> dict[str, Any]:
        """One DNS query the guest's relay received (``{"query": base64, "udp": bool}``), answered by the gateway's
        responder (``egress.dns.answer``: only names the policy admits, NXDOMAIN without an upstream query
        otherwise); an answer over 512 bytes to a UDP query comes back truncated (TC set; the resolver asks again
        over TCP). Past the responder's rate or in-flight bound the query is dropped: ``{"answer": null}``."""
        from moorage.egress.dns import MAX_IN_FLIGHT, MAX_UDP_BYTES, answer, truncated

        query = params.get("query") if isinstance(params, dict) else None
        if not isinstance(query, str) or len(query) > _MAX_DNS_QUERY_B64:
            raise HandlerError(f"query must be a DNS message of at most {MAX_DNS_QUERY} bytes, base64", code=-32602)
        try:
            packet = base64.b64decode(query, validate=True)
        except ValueError:
            raise HandlerError("query must be base64", code=-32602) from None
        if len(packet) > MAX_DNS_QUERY:
            raise HandlerError(f"query must be a DNS message of at most {MAX_DNS_QUERY} bytes", code=-32602)
        if self.dns_in_flight >= MAX_IN_FLIGHT or not self.dns_limiter.take():
            return {"answer": None}
        self.dns_in_flight += 1
        try:
            out = await answer(self.inst, packet)
        except Exception as e:  # noqa: BLE001 - one bad query gets no answer, as on the gateway's own listener
            log.info("dns query failed", error=type(e).__name__)
            out = None
        finally:
            self.dns_in_flight -= 1
        if out is not None and params.get("udp") is not False and len(out) > MAX_UDP_BYTES:
            out = truncated(out)
        return {"answer": base64.b64encode(out).decode() if out is not None else None}

    async def close(self, params: Any, ctx: Any) -> dict[str, Any]:
        conn = self.conns.pop(params.get("conn") if isinstance(params, dict) else None, None)
        if conn is not None:
            _, writer, task = conn
            writer.close()
            # The proxy ends on its own when its client side closes; a tunnel still open is cut.
            asyncio.get_running_loop().call_later(5, task.cancel)
        return {"closed": conn is not None}

    def close_all(self) -> None:
        for _, writer, task in self.conns.values():
            writer.close()
            task.cancel()
        self.conns.clear()
        if self.nic_server is not None:
            self.nic_server.cancel()
            self.nic_server = None
        if self.nic_dns is not None:
            self.nic_dns.cancel()
            self.nic_dns = None


def attach(runtime: Any, sandbox_id: str, channel: Any, ts: Any, agent: str, user: str,
           manifest: Mapping[str, Any]) -> bool:
    """Serve the network of ``sandbox_id``'s agent on ``channel`` (its current connection; a wake makes a new
    one, attached again on its first turn or app request). An agent without [agent.network] gets refusals
    (``_refuse``) instead."""
    if not has_network(manifest):
        _refuse(channel)
        return False
    channel._moorage_no_network = False
    if getattr(channel, "_moorage_network", None) is not None:
        return False
    from moorage.egress.gateway import store_recorder
    from moorage.runtime.host_calls import egress_of, secrets_of
    from moorage.store import Scope

    egress = egress_of(runtime)
    trace_id = uuid.uuid4().hex  # the attempts of one connection of the sandbox share a trace
    inst = egress.instance(dict(manifest), record=store_recorder(ts, lambda: trace_id, Scope.for_user(agent, user),
                                                                   agent=agent, user=user),
                           headers=secrets_of(runtime).header_source(ts, agent, user, dict(manifest)),
                           usage=egress.usage_for(sandbox_id), owner=ts.tenant_id)
    attach_instance(channel, inst, sandbox_id)
    log.info("network attached", sandbox=sandbox_id, agent=agent)
    return True


def attach_instance(channel: Any, inst: Any, sandbox_id: str) -> None:
    """Serve the guest relay's connections on ``channel`` with the egress of ``inst`` (replacing any before)."""
    old = getattr(channel, "_moorage_network", None)
    if old is not None:
        old.close_all()
    relay = _Relay(inst)
    channel.register("egress.open", relay.open)
    channel.register("egress.send", relay.send)
    channel.register("egress.recv", relay.recv)
    channel.register("egress.close", relay.close)
    channel.register("egress.dns", relay.dns)
    channel._moorage_network = relay
    with contextlib.suppress(Exception):
        loop = asyncio.get_running_loop()
        # A micro-VM's NIC (its proxy and DNS), or a process sandbox's DNS address on its own loopback (process_net).
        nic: Any = microvm_net.of_channel(channel) or process_net.of_channel(channel)
        if nic is not None and nic.proxy_listener is not None:
            relay.nic_server = loop.create_task(_serve_nic(nic.proxy_listener, inst))
        if nic is not None and nic.dns_socket is not None:
            relay.nic_dns = loop.create_task(_serve_nic_dns(nic.dns_socket, nic.dns_listener, inst, relay.dns_limiter))
        loop.create_task(_close_with(channel, relay, inst, sandbox_id))


def detach(channel: Any) -> None:
    """Stop serving the relay attached to ``channel`` (a deploy-time install's, in an instance whose packages
    changed): until something attaches again, the guest's connections have nowhere to go."""
    relay = getattr(channel, "_moorage_network", None)
    if relay is None:
        return
    relay.close_all()
    for method in _METHODS:
        channel.unregister(method)
    channel._moorage_network = None
    if getattr(channel, "_moorage_no_network", False):
        _refuse(channel)


def _refuse(channel: Any) -> None:
    """Answer the guest's relay on ``channel`` at once that nothing leaves. The sandbox of an agent without
    [agent.network] may still have a relay listening (its template's builder had one for a deploy-time install, and
    the snapshot kept it), which would otherwise hold each connection for as long as it waits for a network to
    attach (``guest/egress_relay.ATTACH_WAIT_S``, 15 s) before closing it. A deploy-time install's relay attached
    meanwhile takes precedence until ``detach``."""
    if channel is None:
        return
    channel._moorage_no_network = True
    if getattr(channel, "_moorage_network", None) is None:
        for method in ("egress.open", "egress.dns"):
            channel.register(method, _no_network)


async def _no_network(params: Any, ctx: Any) -> dict[str, Any]:
    raise HandlerError("this agent declares no [agent.network]: nothing leaves its sandbox (docs/egress.md)",
                       data={"status": 403})  # the guest's relay answers its client 403 with this


async def _serve_nic(listener: socket.socket, inst: Any) -> None:
    """The gateway's proxy on the NIC's side of the VM's namespace, until the channel (this wake) ends."""
    from moorage.egress.proxy import serve_connection

    open_conns: set[asyncio.Task[None]] = set()

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(open_conns) >= MAX_CONNECTIONS:
            writer.close()  # the same bound as the relay's: the gateway's own limits apply as well
            return
        task = asyncio.current_task()
        open_conns.add(task)  # type: ignore[arg-type]
        try:
            await serve_connection(inst, reader, writer)
        finally:
            open_conns.discard(task)  # type: ignore[arg-type]

    # A duplicate of the launch's listener: closing this server (a re-attach, the end of the wake) leaves the
    # namespace's address bound, so a later attach on the same launch serves it again.
    server = await asyncio.start_server(one, sock=listener.dup())
    try:
        await server.serve_forever()
    finally:
        server.close()
        for task in list(open_conns):
            task.cancel()


async def _serve_nic_dns(sock: socket.socket, listener: socket.socket | None, inst: Any, limiter: Any = None) -> None:
    """The gateway's DNS responder on the NIC's side of the VM's namespace, until the channel (this wake) ends: the
    same ``egress.dns`` responder as the gateway's own listener (only names the policy admits, NXDOMAIN without an
    upstream query otherwise; its rate, in-flight and size bounds; a span for each refusal), over UDP and, for the
    answers a datagram truncates, TCP (one rate for both)."""
    from moorage.egress.dns import Limiter, serve_tcp, serve_udp

    # Duplicates, as for the proxy: closing them leaves the launch's sockets bound for a later attach, and queries
    # sent before now are read from the buffer (or backlog) they wait in.
    limiter = limiter or Limiter()
    transport, _ = await serve_udp(inst, sock=sock.dup(), limiter=limiter)
    server = await serve_tcp(inst, listener.dup(), limiter) if listener is not None else None
    try:
        await asyncio.Event().wait()
    finally:
        transport.close()
        if server is not None:
            server.close()


async def _close_with(channel: Any, relay: _Relay, inst: Any, sandbox_id: str) -> None:
    await channel.wait_closed()
    relay.close_all()
    # The channel closes when the sandbox sleeps or stops: its per-wake egress counters start afresh.
    if getattr(channel, "_moorage_network", None) is relay:
        inst.egress.forget(sandbox_id)


def attach_from_turn(runtime: Any, sandbox_id: str, channel: Any) -> bool:
    """``attach`` with the context of the turn the runtime is starting in ``sandbox_id`` (if any)."""
    binding = next((b for b in list(runtime.turns.values()) if b.sandbox_id == sandbox_id), None)
    if binding is None:
        return False
    return attach(runtime, sandbox_id, channel, binding.ts, binding.entity.agent, binding.entity.user,
                  binding.manifest)
