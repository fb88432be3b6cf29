"""A micro-VM's own network: off by default, and for an agent that declares [agent.network] a NIC whose namespace
holds only the host's gateway (decisions/0013), which decides every connection. pip works unchanged through it,
after a wake and in a fork; its resolver asks the gateway's DNS, which answers only names the policy admits; a
connection that skips the proxy has nowhere to go. "The internet" is loopback
servers this test starts."""

from __future__ import annotations

import base64
import functools
import json
import http.server
import threading
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from moorage.config import Config
from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.guest import egress_relay
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.deploy_packages import SITE_DIR, PackageInstallFailed, install
from moorage.runtime.runtime import Runtime
from moorage.runtime.vm_network import attach_instance
from moorage.sandbox import microvm_net
from moorage.store import EntityKey, Scope
from moorage.store import open_store
from tests.conftest import stop_all_sandboxes
from tests.egress.conftest import NAMES
from tests.egress.servers import Upstream, start_upstream, stop
from tests.runtime.conftest import Env, write_agent
from tests.sandbox.test_conformance import _make_wheel

pytestmark = pytest.mark.asyncio(loop_scope="module")

AGENT = r'''
import errno, os, socket, struct

GET = """
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=60).read().decode())
except urllib.error.HTTPError as e:
    print("ERR", e.code, e.read().decode()[:200])
except Exception as e:
    print("ERR", type(e).__name__)
"""


async def on_message(ctx, message):
    cmd, _, arg = message.partition(" ")
    if cmd == "get":
        return (await ctx.exec(["python3", "-c", GET, arg]))["stdout"].strip()
    if cmd == "raw":  # straight to an address, skipping the proxy
        host, port = arg.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return "connected"
        except OSError as e:
            return "refused: " + errno.errorcode.get(e.errno or 0, type(e).__name__)
    if cmd == "proxy":
        return os.environ.get("HTTPS_PROXY", "none")
    if cmd == "dns":  # one A query of our own to the gateway (its rcode), then the guest's resolver (getaddrinfo)
        query = struct.pack(">6H", 0x6d6f, 0x0100, 1, 0, 0, 0) + b"".join(
            bytes([len(label)]) + label.encode() for label in arg.split(".")) + b"\0" + struct.pack(">2H", 1, 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.settimeout(10)
            s.sendto(query, ("10.0.2.2", 53))
            reply = s.recv(512)
            rcode = "rcode=%d" % (reply[3] & 15) if reply[:2] == query[:2] else "wrong-id"
        except OSError as e:
            rcode = "noanswer:" + errno.errorcode.get(e.errno or 0, type(e).__name__)
        finally:
            s.close()
        try:
            found = sorted({a[4][0] for a in socket.getaddrinfo(arg, 80, socket.AF_INET, socket.SOCK_STREAM)})
        except socket.gaierror as e:
            found = ["gaierror:%d" % e.errno]
        return rcode + " " + ",".join(found)
    if cmd == "dnstcp":  # the same query over TCP (2-byte length first): its rcode and how many answers
        query = struct.pack(">6H", 0x6d6f, 0x0100, 1, 0, 0, 0) + b"".join(
            bytes([len(label)]) + label.encode() for label in arg.split(".")) + b"\0" + struct.pack(">2H", 1, 1)
        try:
            with socket.create_connection(("10.0.2.2", 53), timeout=10) as s:
                s.sendall(struct.pack(">H", len(query)) + query)
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
    if cmd == "resolv":
        try:
            return open("/etc/resolv.conf").read()
        except OSError:
            return "none"
    if cmd == "pip":
        # A plain-HTTP index (the test's) must be named trusted; HTTPS indexes need nothing.
        r = await ctx.exec(["python3", "-m", "pip", "install", "--no-cache-dir", "--index-url", arg,
                            "--trusted-host", arg.split("/")[2].split(":")[0], "moorage-canary-pkg"], timeout=300)
        return "%d %s" % (r["exit_code"], (r["stdout"] + r["stderr"])[-600:])
    if cmd == "import":
        r = await ctx.exec(["python3", "-c", "import moorage_canary_pkg as m; print(m.VALUE)"])
        return (r["stdout"] + r["stderr"]).strip()[-200:]
    return "?"
'''


INDEX_HITS: list[str] = []
#: A name whose answer does not fit in a 512-byte datagram (60 A records).
MANY = [f"127.0.1.{i}" for i in range(1, 61)]

PKG_AGENT = """
import moorage_canary_pkg  # installed at deploy time from requirements.txt


async def on_message(ctx, message):
    return moorage_canary_pkg.VALUE + VERSION
"""


class World:
    env: Env
    allowed: Upstream
    outside: Upstream
    index_port: int


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A PEP 503 package index on loopback: /simple/moorage-canary-pkg/ links one wheel."""
    root = tmp_path_factory.mktemp("index")
    wheel = _make_wheel(root)
    pkg = root / "simple" / "moorage-canary-pkg"
    pkg.mkdir(parents=True)
    (pkg / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')
    (root / "simple" / "index.html").write_text('<a href="moorage-canary-pkg/">moorage-canary-pkg</a>\n')
    class Index(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            INDEX_HITS.append(self.path)

    handler = functools.partial(Index, directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


async def _env(tmp: Path, cfg: Config) -> AsyncIterator[Env]:
    """A runtime on the micro-VM driver with this module's operator settings (its package index)."""
    from tests.sandbox.conftest import DRIVER_FACTORIES

    store = open_store(cfg)
    principal = store.authenticate(store.operator.create_tenant("acme")[1].secret)
    driver = DRIVER_FACTORIES["microvm"](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    try:
        yield Env(rt, manager, principal, cfg)
    finally:
        await rt.aclose()  # its background work ends before what it uses closes
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory, index: int) -> AsyncIterator[World]:
    allowed, outside = start_upstream("A"), start_upstream("B")
    names = {**NAMES, "pypi.test": ["127.0.0.1"], "mirror.test": ["127.0.0.1"], "many.test": MANY}
    tmp = tmp_path_factory.mktemp("vmnet")
    # The operator's policy: loopback is "the internet"; the package index is the test's (pypi.test).
    cfg = Config(data_dir=tmp / "data", sandbox_driver="microvm", egress_allow_cidrs="127.0.0.0/8",
                 egress_package_index=f"http://pypi.test:{index}", package_index_url=f"http://pypi.test:{index}/simple/")
    async for env in _env(tmp, cfg):
        egress = Egress(OperatorPolicy.from_config(cfg), StaticResolver(names))  # test names -> loopback
        env.runtime.egress = env.runtime.templates.egress = egress
        src = write_agent(tmp / "netty", "netty", AGENT,
                          f'[agent.network]\nallow = ["http://api.test:{allowed.port}", "http://pypi.test:{index}", '
                          f'"http://many.test:{allowed.port}"]\n')
        await env.runtime.deploy(env.principal, src)
        w = World()
        w.env, w.allowed, w.outside, w.index_port = env, allowed, outside, index
        try:
            yield w
        finally:
            stop(allowed)
            stop(outside)


async def ask(w: World, message: str, user: str = "ada", agent: str = "netty") -> str:
    return (await w.env.runtime.invoke(w.env.principal, EntityKey(agent, user), message)).reply


async def test_the_gateway_decides_every_connection_of_the_vm(world: World) -> None:
    w = world
    assert await ask(w, "proxy") == "http://10.0.2.2:3128"  # the gateway behind its NIC (decisions/0013)
    assert await ask(w, f"get http://api.test:{w.allowed.port}/hello?x=1") == "A GET /hello?x=1"
    assert w.allowed.paths() == ["/hello?x=1"]
    # Outside the policy: refused by the gateway with its reason, and the server never sees a byte.
    refused = await ask(w, f"get http://evil.test:{w.outside.port}/steal")
    assert refused.startswith("ERR 403") and "evil.test" in refused
    refused = await ask(w, f"get http://api.test:{w.outside.port}/other-port")
    assert refused.startswith("ERR 403")
    assert w.outside.hits == []
    # Skipping the proxy reaches nothing: the VM's own loopback, the gateway's address (only the proxy listens
    # there) and anything off the tap's link (no route: no packet leaves the guest).
    assert await ask(w, f"raw 127.0.0.1:{w.allowed.port}") == "refused: ECONNREFUSED"
    assert await ask(w, f"raw 10.0.2.2:{w.allowed.port}") == "refused: ECONNREFUSED"
    assert await ask(w, f"raw 192.0.2.1:{w.allowed.port}") == "refused: ENETUNREACH"
    assert w.allowed.paths() == ["/hello?x=1"]
    # On the host, the VM's namespace holds its tap and loopback, nothing else (no veth, no route out).
    ts = w.env.store.tenant(w.env.principal)
    async with w.env.manager.turn(ts, Scope.for_user("netty", "ada"), None) as sandbox:  # type: ignore[arg-type]
        nic = microvm_net.of_channel(sandbox.channel)
        assert nic is not None and nic.interfaces() == ["lo", microvm_net.TAP_NAME]
    # Every attempt is a span in the tenant's traces.
    spans = [s for s in ts.spans.recent(limit=1000) if s.name == "egress"]
    decisions = sorted((s.attrs.get("egress.host"), s.attrs.get("egress.decision")) for s in spans)
    assert ("api.test", "allowed") in decisions and any(h == "evil.test" and d != "allowed" for h, d in decisions)


async def test_the_vm_resolves_only_names_its_policy_admits(world: World) -> None:
    w = world
    # The guest's resolver is the gateway on the tap (decisions/0013)...
    assert "nameserver 10.0.2.2" in await ask(w, "resolv")
    # ...which answers a name the policy admits with the address the test resolver gives it (loopback, which the
    # test's operator policy admits)...
    assert await ask(w, "dns api.test") == "rcode=0 127.0.0.1"
    # ...and a made-up name, or one the host could resolve but the policy does not name, with NXDOMAIN (no upstream
    # query: nothing made up leaves through lookups). -2 is EAI_NONAME, what getaddrinfo makes of NXDOMAIN.
    assert await ask(w, "dns made-up-bf3c91.example") == "rcode=3 gaierror:-2"
    assert await ask(w, "dns evil.test") == "rcode=3 gaierror:-2"
    # A name with more addresses than fit in a 512-byte datagram: the UDP answer comes back truncated, and the
    # guest's resolver (glibc) asks again over TCP, which the gateway serves on the same address.
    assert await ask(w, "dnstcp many.test") == "rcode=0 tc=0 answers=60"
    assert await ask(w, "dns many.test") == "rcode=0 " + ",".join(sorted(MANY))
    # The resolved address is no way around the proxy: in the guest it is its own loopback (the test's "internet" is
    # the host's loopback), and nothing on the tap's link but the gateway's ports answers; the name still works
    # through the proxy.
    assert await ask(w, f"raw 127.0.0.1:{w.allowed.port}") == "refused: ECONNREFUSED"
    assert await ask(w, f"raw 10.0.2.2:{w.allowed.port}") == "refused: ECONNREFUSED"
    assert await ask(w, f"get http://api.test:{w.allowed.port}/by-name") == "A GET /by-name"
    # Each refused lookup is a span in the tenant's traces, like a refused connection.
    ts = w.env.store.tenant(w.env.principal)
    refused = {s.attrs.get("egress.host") for s in ts.spans.recent(limit=1000)
               if s.name == "egress" and s.attrs.get("egress.via") == "dns"}
    assert {"made-up-bf3c91.example", "evil.test"} <= refused


async def test_the_guest_resolver_points_at_the_gateway_only_with_a_nic(tmp_path: Path) -> None:
    # The guest's function on a file of the test's: with a NIC it names the gateway (the host's address on the tap);
    # without one (the relay fallback) it removes what it wrote before and leaves anyone else's file alone.
    assert egress_relay.GATEWAY_DNS == microvm_net.GATEWAY_IP
    conf = tmp_path / "resolv.conf"
    egress_relay.point_resolver(True, str(conf))
    assert f"nameserver {microvm_net.GATEWAY_IP}" in conf.read_text()
    egress_relay.point_resolver(False, str(conf))
    assert not conf.exists()
    conf.write_text("nameserver 192.0.2.53\n")
    egress_relay.point_resolver(False, str(conf))
    assert conf.read_text() == "nameserver 192.0.2.53\n"


async def test_network_is_off_by_default(world: World, tmp_path: Path) -> None:
    w = world
    src = write_agent(tmp_path / "quiet", "quiet", AGENT)
    await w.env.runtime.deploy(w.env.principal, src)
    assert await ask(w, "proxy", agent="quiet") == "none"
    assert (await ask(w, f"get http://api.test:{w.allowed.port}/nope", agent="quiet")).startswith("ERR")
    assert (await ask(w, f"raw 127.0.0.1:{w.allowed.port}", agent="quiet")).startswith("refused")
    assert "10.0.2.2" not in await ask(w, "resolv", agent="quiet")  # no NIC, no DNS of ours
    assert "/nope" not in w.allowed.paths()


async def test_pip_installs_through_the_gateway_and_the_package_survives_sleep(world: World) -> None:
    w = world
    out = await ask(w, f"pip http://mirror.test:{w.index_port}/simple/", user="bob")
    # An index the policy does not name: pip fails (it reads the gateway's 403 as an empty index), and the
    # refusal is in the tenant's traces.
    assert not out.startswith("0 ") and "No matching distribution" in out
    ts = w.env.store.tenant(w.env.principal)
    assert any(s.attrs.get("egress.host") == "mirror.test" and s.attrs.get("egress.decision") != "allowed"
               for s in ts.spans.recent(limit=1000) if s.name == "egress")
    out = await ask(w, f"pip http://pypi.test:{w.index_port}/simple/", user="bob")
    assert out.startswith("0 "), out
    assert await ask(w, "import", user="bob") == "from-the-wheel"
    assert await w.env.manager.sleep(ts, Scope.for_user("netty", "bob"))
    assert await ask(w, "import", user="bob") == "from-the-wheel"
    # After the wake the network is attached again on the new channel (a new namespace and tap, same addresses).
    assert await ask(w, f"get http://api.test:{w.allowed.port}/after-wake", user="bob") == "A GET /after-wake"
    assert await ask(w, "dns api.test", user="bob") == "rcode=0 127.0.0.1"  # and its DNS, bound again at launch
    # A fork of bob's VM (its memory and disk) has the package and a network of its own.
    driver = w.env.runtime.driver
    async with w.env.manager.turn(ts, Scope.for_user("netty", "bob"), None) as sandbox:  # type: ignore[arg-type]
        tpl = await driver.make_template(sandbox, "bob-netty-fork-src")
    (fork,) = await driver.fork(tpl, ["bob-netty-fork"])
    try:
        await fork.wake()
        nic = microvm_net.of_channel(fork.channel)
        assert nic is not None and nic.interfaces() == ["lo", microvm_net.TAP_NAME]
        attach_instance(fork.channel, w.env.runtime.egress.instance(
            {"network": {"allow": [f"http://api.test:{w.allowed.port}"]}}), fork.id)
        r = await fork.exec(["python3", "-c", "import moorage_canary_pkg as m; print(m.VALUE)"], timeout=60)
        assert r.stdout.strip() == b"from-the-wheel"
        get = f"import urllib.request; print(urllib.request.urlopen('http://api.test:{w.allowed.port}/fork').read().decode())"
        r = await fork.exec(["python3", "-c", get], timeout=60)
        assert r.stdout.strip() == b"A GET /fork", r.stderr
        # A host restart (a new driver on the same directory) re-adopts the running fork with its network: the
        # namespace is found again through QEMU's tap.
        again = type(driver)(driver.root, driver.config, images_dir=driver.images_dir)
        fork = await again.open("bob-netty-fork")
        nic = microvm_net.of_channel(fork.channel)
        assert nic is not None and nic.interfaces() == ["lo", microvm_net.TAP_NAME]
        attach_instance(fork.channel, w.env.runtime.egress.instance(
            {"network": {"allow": [f"http://api.test:{w.allowed.port}"]}}), fork.id)
        r = await fork.exec(["python3", "-c", get.replace("/fork", "/re-adopted")], timeout=60)
        assert r.stdout.strip() == b"A GET /re-adopted", r.stderr
        r = await fork.exec(["python3", "-c", "import socket; print(socket.gethostbyname('api.test'))"], timeout=60)
        assert r.stdout.strip() == b"127.0.0.1", r.stderr  # DNS's address is bound again in the found namespace
    finally:
        await fork.destroy()
        await driver.delete_template(tpl)


async def test_requirements_are_installed_into_the_template_once(world: World, tmp_path: Path) -> None:
    w = world
    progress: list[str] = []

    def agent(version: str, requirements: str) -> Path:
        src = write_agent(tmp_path / f"pkgd{version}", "pkgd", PKG_AGENT + f"\nVERSION = {version!r}\n")
        (src / "requirements.txt").write_text(requirements)
        return src

    dep = await w.env.runtime.deploy(w.env.principal, agent("", "moorage-canary-pkg\n"), on_progress=progress.append)
    assert any("installing requirements.txt" in p for p in progress), progress
    assert any("/simple/moorage-canary-pkg/" in h for h in INDEX_HITS)
    # The deploy is a trace of the tenant's: a "deploy" span, and under it a span for every request pip made
    # through the gateway (what the build fetched, from where, allowed or not).
    spans = w.env.store.tenant(w.env.principal).spans.recent(limit=2000)
    [deploy] = [s for s in spans if s.name == "deploy" and s.attrs.get("deployment") == dep.id]
    assert deploy.status == "ok" and deploy.attrs["agent"] == "pkgd" and deploy.end_ts >= deploy.start_ts
    fetched = [s for s in spans if s.trace_id == deploy.trace_id and s.name == "egress"]
    assert fetched and all(s.parent_id == deploy.span_id for s in fetched)
    assert {s.attrs.get("egress.host") for s in fetched} == {"pypi.test"}
    assert {s.attrs.get("egress.decision") for s in fetched} == {"allowed"}
    assert await ask(w, "hi", user="ada", agent="pkgd") == "from-the-wheel"
    assert await ask(w, "hi", user="eve", agent="pkgd") == "from-the-wheel"  # another fork of the template
    ts = w.env.store.tenant(w.env.principal)
    assert await w.env.manager.sleep(ts, Scope.for_user("pkgd", "ada"))
    assert await ask(w, "hi", user="ada", agent="pkgd") == "from-the-wheel"
    # Redeploying unchanged requirements (new code) asks the index nothing.
    hits, progress[:] = len(INDEX_HITS), []
    await w.env.runtime.deploy(w.env.principal, agent("-2", "moorage-canary-pkg\n"), on_progress=progress.append)
    assert any("from the cache" in p for p in progress) and len(INDEX_HITS) == hits
    assert await ask(w, "hi", user="zed", agent="pkgd") == "from-the-wheel-2"
    # A package that does not exist fails the deploy with pip's own words; the live version stays.
    with pytest.raises(PackageInstallFailed) as e:
        await w.env.runtime.deploy(w.env.principal, agent("-3", "no-such-package-here\n"))
    assert "No matching distribution found for no-such-package-here" in e.value.message
    # The failed deploy stays in the agent's history (its error in its span): the hint does not say nothing changed.
    assert "nothing was changed" not in (e.value.hint or "") and "deploy again" in (e.value.hint or "")
    ts = w.env.store.tenant(w.env.principal)
    assert ts.deployments.list(ts.agents.get("pkgd").id)[-1].status == "failed"
    failed = [s for s in w.env.store.tenant(w.env.principal).spans.recent(limit=2000)
              if s.name == "deploy" and s.status == "error"]
    assert len(failed) == 1 and "no-such-package-here" in failed[0].attrs["error.message"]
    assert await ask(w, "hi", user="zed", agent="pkgd") == "from-the-wheel-2"


async def test_an_index_outside_the_operator_policy_fails_clearly(world: World) -> None:
    w = world
    ts = w.env.store.tenant(w.env.principal)
    rec = ts.sandboxes.for_scope(Scope.for_user("pkgd", "ada"))
    async with w.env.manager.turn(ts, rec.scope, None) as sandbox:  # type: ignore[arg-type]
        cfg = w.env.cfg.with_(package_index_url=f"http://mirror.test:{w.index_port}/simple/")
        with pytest.raises(PackageInstallFailed) as e:
            await install(sandbox, b"moorage-canary-pkg\n", cfg, w.env.runtime.egress, w.env.cfg.data_dir / "pc",
                          lambda _: None)
    assert "mirror.test" in e.value.message and "not allowed" in e.value.message
    assert "egress_package_index" in (e.value.hint or "")


async def test_a_redeploy_that_adds_requirements_reaches_a_users_existing_vm(world: World, tmp_path: Path) -> None:
    """An instance keeps its VM across a redeploy; when the new deployment asks for packages its template did not
    have, they are installed into that VM (from the host's cache the template build filled) and its processes restart
    in place, with its files, the packages on the agent's path and on that of every process it starts
    (runtime/instance_update.py)."""
    w = world
    ts = w.env.store.tenant(w.env.principal)
    assert await ask(w, "import", user="bea") != "from-the-wheel"  # netty had no requirements: not installed
    rec = ts.sandboxes.for_scope(Scope.for_user("netty", "bea"))
    r = await (await w.env.runtime.driver.open(rec.id)).exec(["sh", "-c", "echo mine > /work/kept"], timeout=60)
    assert r.exit_code == 0
    src = write_agent(tmp_path / "netty2", "netty", AGENT + "\nimport moorage_canary_pkg  # from requirements.txt\n",
                      f'[agent.network]\nallow = ["http://api.test:{w.allowed.port}", "http://pypi.test:{w.index_port}"]\n')
    (src / "requirements.txt").write_text("moorage-canary-pkg\n")
    await w.env.runtime.deploy(w.env.principal, src)
    assert await ask(w, "import", user="bea") == "from-the-wheel"  # a process the agent starts imports it
    assert ts.sandboxes.for_scope(Scope.for_user("netty", "bea")).id == rec.id  # the same instance and VM
    r = await (await w.env.runtime.driver.open(rec.id)).exec(["cat", "/work/kept"], timeout=60)
    assert r.stdout == b"mine\n"
    # Its processes restarted in place with the new deployment's environment (the supervisor's, which init keeps
    # for the supervisor's next start), and the next cold boot gets it too (the VM's recorded environment).
    r = await (await w.env.runtime.driver.open(rec.id)).exec(["cat", "/run/moorage/boot-env"], timeout=60)
    assert json.loads(base64.urlsafe_b64decode(r.stdout))["PYTHONPATH"] == SITE_DIR
    r = await (await w.env.runtime.driver.open(rec.id)).exec(["sh", "-c", "echo $PYTHONPATH"], timeout=60)
    assert r.stdout.decode().strip() == SITE_DIR
    assert w.env.runtime.driver.boot_env(await w.env.runtime.driver.open(rec.id))["PYTHONPATH"] == SITE_DIR
    # Asleep and awake (its RAM now that of the new boot), it still has them; the network is attached again.
    assert await w.env.manager.sleep(ts, Scope.for_user("netty", "bea"))
    assert await ask(w, "import", user="bea") == "from-the-wheel"
    assert await ask(w, f"get http://api.test:{w.allowed.port}/upgraded", user="bea") == "A GET /upgraded"
