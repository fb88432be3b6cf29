"""``[agent] apt = [...]``: Debian packages installed into a micro-VM template at deploy time by apt-get, through the
egress gateway with the operator's package-index policy only, from a Debian mirror this test builds and serves on
loopback (one package, unsigned: the operator's ``package_apt_trusted``). Every fork has the package, it survives a
sleep, an unchanged list comes from the host's cache, and a missing package or a mirror outside the policy fails the
deploy clearly without changing the live version. A redeploy that changes the list reaches users who already have a
VM: added packages (with their dependencies) from the cache or, without it, through the gateway; dropped ones
purged with what only they needed; no restart unless the environment changed."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from moorage.config import Config
from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.fleet.templates import PublishedTemplates
from moorage.objects.local import LocalObjectStore
from moorage.runtime.deploy_apt import AptInstallFailed, install, packages_of
from moorage.runtime.templates import Templates
from moorage.store import EntityKey, Scope
from tests.egress.debian_mirror import build_mirror
from tests.egress.test_vm_network import _env
from tests.runtime.conftest import Env, write_agent

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

MIRROR_HITS: list[str] = []

AGENT = """
async def on_message(ctx, message):
    r = await ctx.exec(["sh", "-c", "moorage-canary; dpkg-query -W -f='${Version}' moorage-canary"])
    return (r["stdout"] + r["stderr"]).strip() + VERSION
"""


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The Debian mirror on loopback (``debian_mirror``): a canary, and a package with a dependency."""
    root = tmp_path_factory.mktemp("mirror")
    build_mirror(root, {"moorage-canary": ("", "from-the-mirror"),
                        "moorage-extra": ("moorage-extra-lib", "moorage-extra"),
                        "moorage-extra-lib": ("", "moorage-extra-lib")})

    class Mirror(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            MIRROR_HITS.append(self.path)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Mirror, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory, mirror: int) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("apt")
    # The operator's policy: the test's mirror (deb.test, a name the test maps to loopback) is the package index.
    cfg = Config(data_dir=tmp / "data", sandbox_driver="microvm", egress_allow_cidrs="127.0.0.0/8",
                 egress_package_index=f"http://deb.test:{mirror}/debian/",
                 package_apt_url=f"http://deb.test:{mirror}/debian", package_apt_trusted=True)
    async for e in _env(tmp, cfg):
        egress = Egress(OperatorPolicy.from_config(cfg), StaticResolver({"deb.test": ["127.0.0.1"],
                                                                         "other.test": ["127.0.0.1"]}))
        e.runtime.egress = e.runtime.templates.egress = egress
        yield e


def agent(tmp: Path, version: str, apt: str) -> Path:
    return write_agent(tmp / f"apty{version}", "apty", AGENT + f"\nVERSION = {version!r}\n", f"apt = {apt}\n")


async def ask(env: Env, user: str) -> str:
    return (await env.runtime.invoke(env.principal, EntityKey("apty", user), "hi")).reply


async def test_the_list_is_checked() -> None:
    assert packages_of({"apt": ["jq", "ffmpeg", "jq"]}) == ["ffmpeg", "jq"]
    assert packages_of({}) == []
    for bad in ("jq; rm -rf /", "-o", "JQ", "jq\n", "a"):
        with pytest.raises(AptInstallFailed):
            packages_of({"apt": [bad]})
    with pytest.raises(AptInstallFailed):
        packages_of({"apt": "jq"})


async def test_apt_packages_are_installed_into_the_template_once(env: Env, tmp_path: Path) -> None:
    progress: list[str] = []
    await env.runtime.deploy(env.principal, agent(tmp_path, "", '["moorage-canary"]'), on_progress=progress.append)
    assert any("installing Debian packages" in p for p in progress), progress
    assert any(h.endswith(".deb") for h in MIRROR_HITS), MIRROR_HITS
    assert await ask(env, "ada") == "from-the-mirror\n1.0"
    assert await ask(env, "eve") == "from-the-mirror\n1.0"  # another fork of the template
    ts = env.store.tenant(env.principal)
    assert await env.manager.sleep(ts, Scope.for_user("apty", "ada"))
    assert await ask(env, "ada") == "from-the-mirror\n1.0"
    # Redeploying an unchanged list (new code) asks the mirror nothing.
    hits, progress[:] = len(MIRROR_HITS), []
    await env.runtime.deploy(env.principal, agent(tmp_path, "-2", '["moorage-canary"]'), on_progress=progress.append)
    assert any("from the cache" in p for p in progress) and len(MIRROR_HITS) == hits, progress
    assert await ask(env, "zed") == "from-the-mirror\n1.0-2"
    # A package the mirror does not have fails the deploy with apt's own words; the live version stays.
    with pytest.raises(AptInstallFailed) as e:
        await env.runtime.deploy(env.principal, agent(tmp_path, "-3", '["moorage-canary", "no-such-package-here"]'))
    assert "Unable to locate package no-such-package-here" in e.value.message
    # The failed deploy stays in the agent's history: the hint does not say nothing changed.
    assert "nothing was changed" not in (e.value.hint or "") and "deploy again" in (e.value.hint or "")
    ts = env.store.tenant(env.principal)
    assert ts.deployments.list(ts.agents.get("apty").id)[-1].status == "failed"
    assert await ask(env, "zed") == "from-the-mirror\n1.0-2"


async def test_a_mirror_outside_the_operator_policy_fails_clearly(env: Env, mirror: int) -> None:
    ts = env.store.tenant(env.principal)
    rec = ts.sandboxes.for_scope(Scope.for_user("apty", "ada"))
    async with env.manager.turn(ts, rec.scope, None) as sandbox:  # type: ignore[arg-type]
        cfg = env.cfg.with_(package_apt_url=f"http://other.test:{mirror}/debian")
        with pytest.raises(AptInstallFailed) as e:
            await install(sandbox, ["moorage-canary"], cfg, env.runtime.egress, env.cfg.data_dir / "pc",
                          lambda _: None)
    assert "other.test" in e.value.message and "not allowed" in e.value.message
    assert "egress_package_index" in (e.value.hint or "")


SHELL = """
async def on_message(ctx, message):
    r = await ctx.exec(["sh", "-c", message])
    return (r["stdout"] + r["stderr"]).strip() + VERSION
"""
#: What a turn reports: the two tools, dpkg's view of the three packages, and whether the guest can reach the
#: mirror through its relay (the agent declares no network: only a deploy-time install's relay would carry it; one
#: left listening is answered 403 with the reason).
REPORT = ("for t in moorage-canary moorage-extra; do command -v $t >/dev/null && $t || echo no-$t; done; "
          "dpkg-query -W -f='${Package}:${db:Status-Abbrev} ' moorage-canary moorage-extra moorage-extra-lib "
          "2>/dev/null; echo; apt-mark showauto | grep moorage || echo none-auto; "
          "python3 -c \"import urllib.request as u, urllib.error as e\ntry:\n "
          "u.urlopen(u.Request('http://deb.test:%d/debian/'), timeout=20); print('mirror-reached')\n"
          "except e.HTTPError as x:\n print('mirror-unreachable', x.code, b'declares no [agent.network]' in x.read())\n"
          "except Exception:\n print('mirror-unreachable')\" 2>/dev/null; "
          "cat /work/keep.txt; kill -0 $(cat /work/bg.pid) 2>/dev/null && echo bg-alive || echo bg-gone; ")


async def test_a_redeploy_that_changes_the_list_reaches_users_existing_vms(env: Env, mirror: int,
                                                                            tmp_path: Path) -> None:
    def shelly(version: str, apt: str) -> Path:
        return write_agent(tmp_path / f"shelly{version}", "shelly", SHELL + f"\nVERSION = {version!r}\n",
                           f"apt = {apt}\n")

    async def say(user: str, command: str) -> str:
        return (await env.runtime.invoke(env.principal, EntityKey("shelly", user), command)).reply

    report = "export HTTP_PROXY=http://127.0.0.1:3128; " + REPORT % mirror
    ts = env.store.tenant(env.principal)
    # iproute2 is the image's own (the guest's init uses it): on a list, it is never moorage's to remove.
    await env.runtime.deploy(env.principal, shelly("v1", '["moorage-canary", "iproute2"]'))
    for user in ("kim", "lee"):  # a file and a long-running process each
        await say(user, "echo kept > /work/keep.txt; (setsid sleep 100000 >/dev/null 2>&1 & echo $! > /work/bg.pid)")
    started = time.monotonic()
    out = await say("kim", report)
    assert out.splitlines()[:2] == ["from-the-mirror", "no-moorage-extra"], out
    # The relay the template's builder left listening is refused at once by the host (this agent has no network),
    # not held until it gives up waiting for a network to attach (15 s).
    assert out.splitlines()[4] == "mirror-unreachable 403 True" and time.monotonic() - started < 12, out
    assert await env.manager.sleep(ts, Scope.for_user("shelly", "lee"))

    # Added: a package with a dependency. Awake kim gets them from the host's cache, in place (its process runs on).
    await env.runtime.deploy(env.principal, shelly("v2", '["moorage-canary", "moorage-extra", "iproute2"]'))
    hits = len(MIRROR_HITS)
    out = await say("kim", report)
    lines = out.splitlines()
    assert lines[:2] == ["from-the-mirror", "moorage-extra"], out
    assert "moorage-extra-lib:ii" in lines[2] and lines[3] == "moorage-extra-lib", out  # the dependency: automatic
    assert lines[4:] == ["mirror-unreachable 403 True", "kept", "bg-alivev2"], out
    assert len(MIRROR_HITS) == hits, MIRROR_HITS[hits:]
    # Asleep lee, with this host's cache gone: apt-get downloads them through the gateway, and the relay that
    # carried the downloads is gone afterwards (the agent declares no network).
    for cached in (env.cfg.data_dir).rglob("apt-*.tar"):
        cached.unlink()
    out = await say("lee", report)
    assert out.splitlines()[:2] == ["from-the-mirror", "moorage-extra"], out
    assert out.splitlines()[4] == "mirror-unreachable 403 True", out
    assert any(h.endswith("moorage-extra_1.0_all.deb") for h in MIRROR_HITS[hits:]), MIRROR_HITS[hits:]

    # Dropped: the package goes (purged); the other, and the dependency it needs, stay; so does the image's own.
    await env.runtime.deploy(env.principal, shelly("v3", '["moorage-extra"]'))
    lines = (await say("kim", report)).splitlines()
    assert lines[:2] == ["no-moorage-canary", "moorage-extra"], lines
    assert "moorage-canary" not in lines[2] and "moorage-extra-lib:ii" in lines[2], lines
    assert lines[-2:] == ["kept", "bg-alivev3"], lines
    assert await say("kim", "dpkg-query -W -f='${db:Status-Abbrev}' iproute2") == "iiv3"

    # None left: the environment changes too (no relay for apt), so the VM restarts: the files stay.
    await env.runtime.deploy(env.principal, shelly("v4", "[]"))
    lines = (await say("kim", report)).splitlines()
    assert lines[:2] == ["no-moorage-canary", "no-moorage-extra"], lines
    assert "moorage" not in lines[2], lines
    assert lines[-2:] == ["kept", "bg-gonev4"], lines


async def test_another_hosts_vm_installs_the_debian_packages_the_templates_builder_published(
        env: Env, tmp_path: Path) -> None:
    """In a fleet, the .deb files a template's builder fetched are published beside the template, so a VM on a
    host that did not build it gets a changed list from there (apt on that host may not reach the mirror)."""
    objects = LocalObjectStore(tmp_path / "bucket")
    published = PublishedTemplates(objects, env.runtime.driver)
    env.runtime.templates.published = published
    try:
        src = write_agent(tmp_path / "pubby", "pubby", AGENT + "\nVERSION = ''\n", 'apt = ["moorage-extra"]\n')
        dep = await env.runtime.deploy(env.principal, src)
    finally:
        env.runtime.templates.published = None
    ref = env.runtime.templates.cached(dep.id)
    assert ref is not None
    [entry] = [o.key for o in objects.iter(f"templates/{ref.id}/packages/")]
    assert entry.rsplit("/", 1)[1].startswith("apt-"), entry

    # Another host: an empty cache, and an egress that admits no mirror (apt would be refused).
    other = Templates(tmp_path / "templates-b", env.runtime.driver, tmp_path / "packages-b")
    other.published = published
    other.egress = Egress(OperatorPolicy.from_config(env.cfg.with_(egress_package_index="")),
                          StaticResolver({"deb.test": ["127.0.0.1"]}))
    ts = env.store.tenant(env.principal)
    rec = ts.sandboxes.for_scope(Scope.for_user("apty", "ada"))
    async with env.manager.turn(ts, rec.scope, None) as sandbox:  # type: ignore[arg-type]
        said: list[str] = []
        with pytest.raises(AptInstallFailed, match="not allowed"):  # without the template to fetch from
            await other.update_apt(sandbox, ["moorage-extra"], dep.agent_id, said.append)
        # Installed from the published copy, and the list this VM had (apty's moorage-canary) removed.
        assert await other.update_apt(sandbox, ["moorage-extra"], dep.agent_id, said.append, ref) == \
            "cached, removed 1"
        assert "Debian packages from the template's published copy" in said, said
        r = await sandbox.exec(["moorage-extra"], timeout=30)
        assert r.stdout.strip() == b"moorage-extra", r
