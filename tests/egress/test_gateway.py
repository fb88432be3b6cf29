"""The gateway: CONNECT tunnels, plain-HTTP forwarding with bound secret headers, request framing, limits,
spans in the tenant's store, the DNS responder, and per-instance listeners (TCP and unix socket)."""

from __future__ import annotations

import asyncio
import socket
import time
import tracemalloc
from pathlib import Path

import pytest
from dnslib import RCODE, DNSRecord

from moorage.egress import dns
from moorage.egress import Egress, Gateway, Limits, OperatorPolicy, StaticResolver, Target, store_recorder
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.egress.conftest import TEST_OPERATOR
from tests.egress.servers import MIB, Upstream


async def _exchange(port: int, raw: bytes, *, read_all: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read() if read_all else reader.read(65536), 20)
    writer.close()
    return data


@pytest.fixture
async def gateway(egress: Egress):
    g = Gateway(egress)
    yield g
    await g.close()


async def test_connect_tunnels_bytes_to_an_allowed_host_only(gateway: Gateway, egress: Egress, upstream: Upstream,
                                                             outside: Upstream) -> None:
    b = await gateway.bind("i1", egress.instance({"egress": {"allow": [f"https://api.test:{upstream.port}"]}}), dns=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", b.proxy_port)
    writer.write(f"CONNECT api.test:{upstream.port} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    # The tunnel is opaque: whatever the client speaks inside (TLS in real use) reaches the upstream as it is.
    writer.write(b"GET /through HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"A GET /through")
    writer.close()
    denied = await _exchange(b.proxy_port, f"CONNECT 127.0.0.1:{outside.port} HTTP/1.1\r\n\r\n".encode())
    assert denied.startswith(b"HTTP/1.1 403") and b"not allowed" in denied
    assert outside.hits == [] and upstream.paths() == ["/through"]


async def test_plain_http_gets_bound_headers_and_loses_proxy_credentials(gateway: Gateway, egress: Egress,
                                                                          upstream: Upstream) -> None:
    async def headers(t: Target) -> dict[str, str]:
        return {"Authorization": "Bearer from-the-host"}

    b = await gateway.bind("i1", egress.instance({"egress": {"allow": [f"http://api.test:{upstream.port}"]}},
                                                 headers=headers), dns=False)
    out = await _exchange(b.proxy_port, (f"GET http://api.test:{upstream.port}/p HTTP/1.1\r\nHost: evil.test\r\n"
                                         "Authorization: guest\r\nProxy-Authorization: Basic eA==\r\n\r\n").encode())
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"A GET /p")
    hit = upstream.hits[0]
    assert hit.headers["authorization"] == "Bearer from-the-host" and hit.headers["host"] == f"api.test:{upstream.port}"
    assert "proxy-authorization" not in hit.headers


async def test_request_bodies_are_framed_and_nothing_after_them_is_forwarded(gateway: Gateway, egress: Egress,
                                                                              upstream: Upstream) -> None:
    b = await gateway.bind("i1", egress.instance({"egress": {"allow": [f"http://paths.test:{upstream.port}/v1"]}}),
                           dns=False)
    url = f"http://paths.test:{upstream.port}"
    smuggled = f"GET {url}/admin HTTP/1.1\r\nHost: x\r\n\r\n"
    out = await _exchange(b.proxy_port, (f"POST {url}/v1/a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" + smuggled).encode())
    assert out.startswith(b"HTTP/1.1 200")
    chunked = f"POST {url}/v1/b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n" + smuggled
    out = await _exchange(b.proxy_port, chunked.encode())
    assert out.startswith(b"HTTP/1.1 200")
    assert upstream.paths() == ["/v1/a", "/v1/b"] and upstream.hits[0].body == b"hello"
    both = f"POST {url}/v1/c HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert (await _exchange(b.proxy_port, both.encode())).startswith(b"HTTP/1.1 400")
    not_last = f"POST {url}/v1/d HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"
    assert (await _exchange(b.proxy_port, not_last.encode())).startswith(b"HTTP/1.1 400")
    assert upstream.paths() == ["/v1/a", "/v1/b"]


async def test_an_endless_body_streams_through_without_being_held(gateway: Gateway, egress: Egress,
                                                                  upstream: Upstream) -> None:
    b = await gateway.bind("i1", egress.instance({"egress": {"allow": [f"http://api.test:{upstream.port}"]}}), dns=False)
    tracemalloc.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.proxy_port)
        writer.write(f"GET http://api.test:{upstream.port}/endless HTTP/1.1\r\n\r\n".encode())
        got = 0
        while got < 32 * MIB:
            got += len(await asyncio.wait_for(reader.read(1 << 16), 10))
        writer.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, peak


async def test_per_instance_limits_refuse_past_the_limit(upstream: Upstream) -> None:
    eg = Egress(OperatorPolicy(TEST_OPERATOR.addresses, limits=Limits(max_connections=1, connects_per_s=1000,
                                                                      max_bytes=4 * MIB)),
                StaticResolver({"api.test": ["127.0.0.1"]}))
    g = Gateway(eg)
    inst = eg.instance({"egress": {"allow": [f"https://api.test:{upstream.port}", f"http://api.test:{upstream.port}"]}})
    b = await g.bind("i1", inst, dns=False)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.proxy_port)
        writer.write(f"CONNECT api.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        second = await _exchange(b.proxy_port, f"CONNECT api.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert second.startswith(b"HTTP/1.1 429")
        writer.close()
        await asyncio.sleep(0.2)
        # The byte budget (4 MiB) ends a download that goes past it.
        big = await _exchange(b.proxy_port, f"GET http://api.test:{upstream.port}/bytes/{16 * MIB} HTTP/1.1\r\n\r\n".encode())
        assert len(big) < 5 * MIB
    finally:
        await g.close()


async def test_every_attempt_is_a_span_in_the_tenants_store(tmp_path: Path, egress: Egress, upstream: Upstream,
                                                            outside: Upstream) -> None:
    store = Store(SQLiteBackend(tmp_path / "store"))
    try:
        ts = store.tenant(store.authenticate(store.operator.create_tenant("acme")[1].secret))

        async def headers(t: Target) -> dict[str, str]:
            return {"X-Api-Key": "SECRET-VALUE-123"}

        inst = egress.instance({"egress": {"allow": [f"http://api.test:{upstream.port}"]}},
                               record=store_recorder(ts, lambda: "trace-egress-1", agent="bot"), headers=headers)
        g = Gateway(egress)
        b = await g.bind("i1", inst, dns=False)
        await _exchange(b.proxy_port, f"GET http://api.test:{upstream.port}/ok HTTP/1.1\r\n\r\n".encode())
        await _exchange(b.proxy_port, f"GET http://127.0.0.1:{outside.port}/no HTTP/1.1\r\n\r\n".encode())
        await _exchange(b.proxy_port, f"CONNECT evil.test:443 HTTP/1.1\r\n\r\n".encode())
        await g.close()
        deadline = time.monotonic() + 10
        while len(ts.spans.trace("trace-egress-1")) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        spans = ts.spans.trace("trace-egress-1")
        got = sorted((s.attrs["egress.via"], s.attrs["egress.host"], s.status) for s in spans)
        assert got == [("proxy-connect", "evil.test", "denied"), ("proxy-http", "127.0.0.1", "denied"),
                       ("proxy-http", "api.test", "ok")]
        ok = next(s for s in spans if s.status == "ok")
        assert ok.attrs["http.status_code"] == 200 and ok.attrs["egress.bytes_received"] > 0 and ok.attrs["agent"] == "bot"
        assert "SECRET-VALUE-123" not in repr(spans)
        assert upstream.hits[0].headers["x-api-key"] == "SECRET-VALUE-123"
    finally:
        store.close()


async def _dns(port: int, name: str, qtype: str = "A") -> DNSRecord:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    class P(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):  # type: ignore[no-untyped-def]
            fut.set_result(DNSRecord.parse(data))

    transport, _ = await loop.create_datagram_endpoint(P, remote_addr=("127.0.0.1", port))
    transport.sendto(DNSRecord.question(name, qtype).pack())
    try:
        return await asyncio.wait_for(fut, 5)
    finally:
        transport.close()


async def test_dns_answers_only_names_the_policy_admits() -> None:
    eg = Egress(TEST_OPERATOR, StaticResolver({"api.test": ["127.0.0.1"], "internal.test": ["10.0.0.9"],
                                               "other.test": ["127.0.0.1"]}))
    g = Gateway(eg)
    b = await g.bind("i1", eg.instance({"egress": {"allow": ["https://api.test", "https://internal.test"]}}))
    try:
        ok = await _dns(b.dns_port, "api.test")
        assert ok.header.rcode == RCODE.NOERROR and [str(r.rdata) for r in ok.rr] == ["127.0.0.1"]
        assert (await _dns(b.dns_port, "api.test", "AAAA")).rr == []
        # Unlisted names are never looked up upstream (no exfiltration by made-up names).
        assert (await _dns(b.dns_port, "c2VjcmV0.other.test")).header.rcode == RCODE.NXDOMAIN
        assert (await _dns(b.dns_port, "other.test")).header.rcode == RCODE.NXDOMAIN
        assert (await _dns(b.dns_port, "internal.test")).header.rcode == RCODE.NXDOMAIN  # decided: private
    finally:
        await g.close()


async def test_a_binding_can_listen_on_a_unix_socket(tmp_path: Path, egress: Egress, upstream: Upstream) -> None:
    g = Gateway(egress)
    sock = tmp_path / "gw" / "proxy.sock"
    b = await g.bind("vm-1", egress.instance({"egress": {"allow": [f"http://api.test:{upstream.port}"]}}),
                     unix_path=sock, dns=False)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(f"GET http://api.test:{upstream.port}/u HTTP/1.1\r\n\r\n".encode())
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"A GET /u")
        writer.close()
        assert g.get("vm-1") is b
    finally:
        await g.close()
    assert not sock.exists() and g.get("vm-1") is None


async def test_dns_over_a_stream_socket_for_guestfwd(tmp_path: Path) -> None:
    eg = Egress(TEST_OPERATOR, StaticResolver({"api.test": ["127.0.0.1"]}))
    g = Gateway(eg)
    sock = tmp_path / "dns.sock"
    await g.bind("i1", eg.instance({"egress": {"allow": ["https://api.test"]}}), dns=False, dns_unix_path=sock)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        for name, rcode in (("api.test", RCODE.NOERROR), ("leak.other.test", RCODE.NXDOMAIN)):
            q = DNSRecord.question(name).pack()
            writer.write(len(q).to_bytes(2, "big") + q)
            size = int.from_bytes(await reader.readexactly(2), "big")
            reply = DNSRecord.parse(await reader.readexactly(size))
            assert reply.header.rcode == rcode
        writer.close()
    finally:
        await g.close()
    assert not sock.exists()


async def test_expect_continue_is_answered_by_the_gateway(gateway: Gateway, egress: Egress, upstream: Upstream) -> None:
    b = await gateway.bind("i1", egress.instance({"egress": {"allow": [f"http://api.test:{upstream.port}"]}}), dns=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", b.proxy_port)
    writer.write(f"PUT http://api.test:{upstream.port}/up HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n".encode())
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"data")
    assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
    writer.close()
    assert upstream.hits[0].body == b"data" and "expect" not in upstream.hits[0].headers


async def test_dns_over_tcp_gives_the_whole_answer_a_datagram_truncates_within_one_rate() -> None:
    """The responder a VM's NIC reaches (runtime/vm_network.py) over UDP and TCP: a name with more addresses than fit
    in 512 bytes comes back truncated over UDP (TC set) and whole over TCP; both sides take from one rate; at most
    ``MAX_TCP_CONNECTIONS`` connections are served at once."""
    many = [f"127.0.1.{i}" for i in range(1, 61)]
    eg = Egress(TEST_OPERATOR, StaticResolver({"many.test": many}))
    inst = eg.instance({"egress": {"allow": ["https://many.test"]}})
    now = [0.0]  # the rate's clock stands still unless the test moves it: a slow host refills nothing meanwhile
    limiter = dns.Limiter(clock=lambda: now[0])
    transport, udp_port = await dns.serve_udp(inst, "127.0.0.1", 0, limiter=limiter)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    server = await dns.serve_tcp(inst, listener, limiter)
    port = listener.getsockname()[1]

    async def over_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> DNSRecord | None:
        q = DNSRecord.question(name).pack()
        writer.write(len(q).to_bytes(2, "big") + q)
        try:
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), 5), "big")
        except asyncio.IncompleteReadError:
            return None  # the responder closed the connection
        return DNSRecord.parse(await reader.readexactly(size))

    try:
        short = await _dns(udp_port, "many.test")
        # Truncated with its question kept (a resolver ignores a reply to a question it did not ask).
        assert short.header.tc == 1 and short.rr == [] and [str(q.qname) for q in short.questions] == ["many.test."]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        whole = await over_tcp(reader, writer, "many.test")
        assert whole is not None and whole.header.tc == 0 and sorted(str(r.rdata) for r in whole.rr) == sorted(many)
        # The policy holds over TCP as over UDP.
        refused = await over_tcp(reader, writer, "leak.other.test")
        assert refused is not None and refused.header.rcode == RCODE.NXDOMAIN
        # Connections past the cap are closed at once; the open ones are still served.
        extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(dns.MAX_TCP_CONNECTIONS)]
        closed = [await asyncio.wait_for(r.read(), 5) for r, _ in extra[dns.MAX_TCP_CONNECTIONS - 1:]]
        assert closed == [b""]
        # One rate for both: spent over UDP, the next TCP query ends its connection unanswered.
        while limiter.take():
            pass
        assert await over_tcp(reader, writer, "many.test") is None
        # And it refills with time: a new connection is answered again.
        now[0] += 1.0
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        again = await over_tcp(r2, w2, "many.test")
        assert again is not None and len(again.rr) == len(many)
        w2.close()
        for _, w in [*extra, (reader, writer)]:
            w.close()
    finally:
        server.close()
        transport.close()
