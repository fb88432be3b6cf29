"""The channel relay where it is a sandbox's only way out. Its DNS: a network agent's resolver asks 127.0.0.1:53. In
a process sandbox the host bound that address in the sandbox's own network namespace and serves the gateway's
responder there (sandbox/process_net.py); in a micro-VM without a NIC (a host that cannot make a tap) the guest's
relay listens there and hands each query to the host over the channel (``egress.dns``). Either way only names the
agent's policy admits resolve; every other name is NXDOMAIN without an upstream query, a flood is bounded, and nothing
in a process sandbox gets a capability or a privileged port for it. A connection to the relay's proxy address that
the host will not open is answered with the reason. "The internet" is loopback names the test resolver knows."""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator
from unittest import mock

import pytest
import pytest_asyncio

from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.sandbox import microvm_net, process_net
from moorage.store import EntityKey, Scope
from tests.egress.conftest import NAMES
from tests.egress.servers import Upstream, start_upstream, stop
from tests.runtime.conftest import Env, make_env, write_agent

pytestmark = pytest.mark.asyncio(loop_scope="module")

AGENT = r'''
import asyncio, errno, os, socket, struct, time

# Sockets are used on a thread: a blocking call on the supervisor's event loop would stall the guest's own relay
# (docs/egress.md), which serves these lookups in a micro-VM without a NIC.


def query(name, qid=0x6d6f):
    return struct.pack(">6H", qid, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0" + struct.pack(">2H", 1, 1)


def udp(name):  # one A query of our own: its rcode
    q = query(name)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.settimeout(3)
        s.sendto(q, ("127.0.0.1", 53))
        reply = s.recv(512)
        return "rcode=%d" % (reply[3] & 15) if reply[:2] == q[:2] else "wrong-id"
    except OSError as e:
        return "noanswer:" + errno.errorcode.get(e.errno or 0, type(e).__name__)
    finally:
        s.close()


def tcp(name):  # the same query over TCP (2-byte length first): its rcode and how many answers
    q = query(name)
    try:
        with socket.create_connection(("127.0.0.1", 53), timeout=10) as s:
            s.sendall(struct.pack(">H", len(q)) + q)
            data = b""
            while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
                more = s.recv(65536)
                if not more:
                    return "closed after %d bytes" % len(data)
                data += more
        reply = data[2:]
        return "rcode=%d tc=%d answers=%d" % (reply[3] & 15, (reply[2] >> 1) & 1, struct.unpack(">H", reply[6:8])[0])
    except OSError as e:
        return "tcp error: " + errno.errorcode.get(e.errno or 0, type(e).__name__)


def flood(name, n):  # as many queries as fast as the socket takes them; how many were answered, in how long
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    started = time.monotonic()
    for i in range(n):
        s.sendto(query(name, i & 0xffff), ("127.0.0.1", 53))
    answered = 0
    s.settimeout(1.5)
    try:
        while True:
            s.recv(512)
            answered += 1
    except OSError:
        pass
    s.close()
    return "%d %.3f" % (answered, time.monotonic() - started - 1.5)


def privileges():  # what a process of the sandbox holds: capabilities, and the low ports it may bind
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    caps = " ".join("%s=%s" % (k, status[k].strip()) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
    out = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        for port in (53, 80):
            s = socket.socket(socket.AF_INET, kind)
            try:
                s.bind(("127.0.0.1", port))
                out.append("bound:%d" % port)
            except OSError as e:
                out.append(errno.errorcode.get(e.errno or 0, "?"))
            finally:
                s.close()
    return caps + " " + " ".join(out)


def refused_at_once():  # one more request through the relay: answered 429 (else the policy's 403 for its name)
    with socket.create_connection(("127.0.0.1", 3128), timeout=30) as s:
        s.sendall(b"GET http://not-allowed.test/ HTTP/1.1\r\nHost: not-allowed.test\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.1 429")


def through_relay(held, url, full=False):  # ``held`` connections kept open, then one GET of ``url``
    kept = [socket.create_connection(("127.0.0.1", 3128), timeout=10) for _ in range(held)]
    deadline = time.monotonic() + 60
    while full and not refused_at_once():  # until the host holds every one of them (each opened in its turn)
        assert time.monotonic() < deadline, "the relay's connections were never all open"
    try:
        with socket.create_connection(("127.0.0.1", 3128), timeout=30) as s:
            s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                       % (url, url.split("/")[2])).encode())
            data = b""
            while True:
                more = s.recv(65536)
                if not more:
                    break
                data += more
    finally:
        for k in kept:
            k.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    retry = [h for h in lines if h.lower().startswith("retry-after:")]
    return " | ".join([lines[0]] + retry + [body.decode(errors="replace").strip()])


GETADDRINFO = ("import socket, sys\ntry:\n print(','.join(sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[1], 80,"
               " socket.AF_INET, socket.SOCK_STREAM)})))\nexcept socket.gaierror as e:\n print('gaierror:%d' % e.errno)")


async def on_message(ctx, message):
    cmd, _, arg = message.partition(" ")
    if cmd == "resolv":
        try:
            return open("/etc/resolv.conf").read()
        except OSError:
            return "none"
    if cmd == "dns":  # our own query, then the sandbox's resolver (getaddrinfo, in another process)
        rcode = await asyncio.to_thread(udp, arg)
        return rcode + " " + (await ctx.exec(["python3", "-c", GETADDRINFO, arg]))["stdout"].strip()
    if cmd == "dnstcp":
        return await asyncio.to_thread(tcp, arg)
    if cmd == "flood":
        name, n = arg.split()
        return await asyncio.to_thread(flood, name, int(n))
    if cmd == "privileges":
        return await asyncio.to_thread(privileges)
    if cmd == "relay":
        held, url, *full = arg.split()
        return await asyncio.to_thread(through_relay, int(held), url, bool(full))
    return "?"
'''

#: A name whose answer does not fit in a 512-byte datagram (60 A records).
MANY = [f"127.0.1.{i}" for i in range(1, 61)]


class RecordingResolver(StaticResolver):
    """The test's "upstream DNS": every name it is asked is recorded."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        super().__init__(table)
        self.asked: list[str] = []

    async def resolve(self, host: str, owner: str = ""):  # type: ignore[no-untyped-def]
        self.asked.append(host)
        return await super().resolve(host, owner)


class World:
    driver: str
    env: Env
    allowed: Upstream
    resolver: RecordingResolver


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["process", "microvm"])
async def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("relaydns")
    allowed = start_upstream("A")
    resolver = RecordingResolver({**NAMES, "many.test": MANY})
    # The micro-VM as on a host that cannot make a tap: no NIC, the channel relay is its only way out.
    with mock.patch.object(microvm_net, "available", lambda: False):
        async for w in _world(request.param, tmp, allowed, resolver):
            yield w


async def _world(driver: str, tmp: object, allowed: Upstream, resolver: RecordingResolver) -> AsyncIterator[World]:
    async for env in make_env(tmp, driver):  # type: ignore[arg-type]
        env.runtime.egress = env.runtime.templates.egress = Egress(OperatorPolicy.from_config(env.cfg), resolver)
        await env.runtime.deploy(env.principal, write_agent(
            tmp / "netty", "netty", AGENT,
            f'[agent.network]\nallow = ["http://api.test:{allowed.port}", "http://many.test:{allowed.port}"]\n'))
        await env.runtime.deploy(env.principal, write_agent(tmp / "quiet", "quiet", AGENT))
        w = World()
        w.driver, w.env, w.allowed, w.resolver = driver, env, allowed, resolver
        try:
            yield w
        finally:
            stop(allowed)


async def ask(w: World, message: str, user: str = "ada", agent: str = "netty") -> str:
    return (await w.env.runtime.invoke(w.env.principal, EntityKey(agent, user), message)).reply


async def test_a_network_agent_resolves_only_names_its_policy_admits(world: World) -> None:
    w = world
    assert "nameserver 127.0.0.1" in await ask(w, "resolv")
    # A name the policy admits resolves, in any process of the sandbox, to what the host's resolver says.
    assert await ask(w, "dns api.test") == "rcode=0 127.0.0.1"
    # A made-up name, or one the host's resolver knows but the policy does not name: NXDOMAIN (getaddrinfo's
    # EAI_NONAME, -2), and the host's resolver was never asked (nothing made up leaves through lookups).
    w.resolver.asked.clear()
    assert await ask(w, "dns made-up-7c1e.example") == "rcode=3 gaierror:-2"
    assert await ask(w, "dns evil.test") == "rcode=3 gaierror:-2"
    assert w.resolver.asked == []
    # An answer too big for a datagram comes back truncated; the resolver asks again over TCP, served alike.
    assert await ask(w, "dnstcp many.test") == "rcode=0 tc=0 answers=60"
    assert await ask(w, "dns many.test") == "rcode=0 " + ",".join(sorted(MANY))
    # Each refused lookup is a span in the tenant's traces, like a refused connection.
    ts = w.env.store.tenant(w.env.principal)
    refused = {s.attrs.get("egress.host") for s in ts.spans.recent(limit=1000)
               if s.name == "egress" and s.attrs.get("egress.via") == "dns"}
    assert {"made-up-7c1e.example", "evil.test"} <= refused


async def test_a_flood_of_lookups_is_bounded(world: World) -> None:
    w = world
    await ask(w, "dns api.test")  # awake, attached
    w.resolver.asked.clear()
    answered, took = (await ask(w, "flood api.test 2000")).split()
    # The responder's bucket: a burst of 100, then 50 a second; the rest are dropped, never queued or asked upstream.
    bound = 100 + 50 * (float(took) + 1.5) + 5
    assert 0 < int(answered) <= bound
    assert len(w.resolver.asked) <= bound
    # The sandbox's lookups work again once the bucket refills.
    await asyncio.sleep(2.5)
    assert await ask(w, "dns api.test") == "rcode=0 127.0.0.1"


async def test_who_serves_the_address(world: World) -> None:
    w = world
    ts = w.env.store.tenant(w.env.principal)
    got = await ask(w, "privileges")
    async with w.env.manager.turn(ts, Scope.for_user("netty", "ada"), None) as sandbox:  # type: ignore[arg-type]
        if w.driver == "process":
            # The host: the sockets the sandbox's queries reach (its namespace's 127.0.0.1:53) are the host's...
            dns = process_net.of_channel(sandbox.channel)
            assert dns is not None and dns.dns_socket is not None and dns.dns_listener is not None
        else:
            # The guest's relay, in a VM without a network device.
            assert microvm_net.of_channel(sandbox.channel) is None and process_net.of_channel(sandbox.channel) is None
    if w.driver == "process":
        # ...and the sandbox got nothing for it: no capability in any set, no low port of its own (not even 53).
        assert "CapInh=0000000000000000 CapPrm=0000000000000000 CapEff=0000000000000000 CapBnd=0000000000000000 " \
               "CapAmb=0000000000000000" in got
        assert got.endswith("EACCES EACCES EACCES EACCES")
    else:
        assert got.endswith("EADDRINUSE bound:80 EADDRINUSE bound:80")  # the VM's root; 53 is the relay's


async def test_without_a_network_there_is_no_resolver(world: World) -> None:
    w = world
    assert "127.0.0.1" not in await ask(w, "resolv", agent="quiet")
    assert (await ask(w, "dns api.test", agent="quiet")).startswith("noanswer:")
    if w.driver == "process":
        assert await ask(w, "resolv", agent="quiet") == "none"
        assert (await ask(w, "privileges", agent="quiet")).endswith("EACCES EACCES EACCES EACCES")


async def test_only_an_agent_with_its_own_network_gets_the_address() -> None:
    # [agent.network] (its sandboxes ask for a NIC too); a template's relay for deploy-time packages is not one.
    assert process_net.wanted({"MOORAGE_NETWORK": "1", microvm_net.WANT_ENV: "1"})
    assert not process_net.wanted({"MOORAGE_NETWORK": "1", "PYTHONPATH": "/work/.moorage/site"})


async def test_dns_after_a_sleep_and_wake(world: World) -> None:
    w = world
    ts = w.env.store.tenant(w.env.principal)
    assert await ask(w, "dns api.test", user="bo") == "rcode=0 127.0.0.1"
    assert await w.env.manager.sleep(ts, Scope.for_user("netty", "bo"))
    assert await ask(w, "dns api.test", user="bo") == "rcode=0 127.0.0.1"
    w.resolver.asked.clear()
    assert await ask(w, "dns evil.test", user="bo") == "rcode=3 gaierror:-2"
    assert w.resolver.asked == []


async def test_dns_after_the_sandbox_died(world: World) -> None:
    w = world
    if w.driver != "process":
        return  # a VM's guest relay starts with its supervisor; nothing of the host's to rebind
    ts = w.env.store.tenant(w.env.principal)
    assert await ask(w, "dns api.test", user="cy") == "rcode=0 127.0.0.1"
    async with w.env.manager.turn(ts, Scope.for_user("netty", "cy"), None) as sandbox:  # type: ignore[arg-type]
        old = process_net.of_channel(sandbox.channel)
        os.killpg(sandbox._pid, 9)  # type: ignore[attr-defined]
    for _ in range(200):
        if sandbox.state.value != "running":
            break
        await asyncio.sleep(0.05)
    # The next start binds the address in the new sandbox's namespace (the dead one's sockets are closed).
    assert await ask(w, "dns api.test", user="cy") == "rcode=0 127.0.0.1"
    assert old is not None and old.dns_socket is None


async def test_egress_dns_refuses_what_is_not_a_small_query() -> None:
    # The host call's own bounds, before any answer is made: a guest cannot make the host parse or hold more.
    import base64

    from moorage.runtime.vm_network import _Relay
    from moorage.sandbox.channel import HandlerError

    relay = _Relay(inst=None)
    for params in ({"query": base64.b64encode(b"\0" * 513).decode()}, {"query": "x" * 5000}, {"query": "not base64!"},
                   {"query": 7}, {}, []):
        with pytest.raises(HandlerError) as e:
            await relay.dns(params, None)
        assert e.value.code == -32602
    # Past the responder's rate the query is dropped (no answer), never queued.
    relay.dns_limiter._tokens = 0
    assert await relay.dns({"query": base64.b64encode(b"\0" * 12).decode()}, None) == {"answer": None}


async def test_a_connection_the_relay_cannot_open_is_answered_with_the_reason(world: World) -> None:
    """The relay closed a connection the host would not open without a word (curl: "Empty reply from server"); now
    the client gets an HTTP answer that says why, and the sandbox's connections work again once it is under its
    limit."""
    from moorage.runtime.vm_network import MAX_CONNECTIONS

    w = world
    url = f"http://api.test:{w.allowed.port}/x"
    assert (await ask(w, f"relay 0 {url}")).startswith("HTTP/1.1 200 OK")
    refused = await ask(w, f"relay {MAX_CONNECTIONS} {url} full")
    assert refused == (f"HTTP/1.1 429 Too Many Requests | Retry-After: 1 | moorage egress relay: at most "
                       f"{MAX_CONNECTIONS} connections at once through this sandbox's relay"), refused
    # Those closed, under the limit again (each is closed on the host a moment after the guest closes it).
    deadline = asyncio.get_running_loop().time() + 30
    while not (again := await ask(w, f"relay {MAX_CONNECTIONS - 1} {url}")).startswith("HTTP/1.1 200 OK"):
        assert again.startswith("HTTP/1.1 429") and asyncio.get_running_loop().time() < deadline, again
        await asyncio.sleep(0.5)
