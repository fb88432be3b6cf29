"""``[agent] apt = [...]``: Debian packages installed into a micro-VM template at deploy time by apt-get, through the
egress gateway with the operator's package-index policy only, from a Debian mirror this test builds and serves on
loopback (one package, unsigned: the operator's ``package_apt_trusted``). Every fork has the package, it survives a
sleep, an unchanged list comes from the host's cache, and a missing package or a mirror outside the policy fails the
deploy clearly without changing the live version."""

from __future__ import annotations

import functools
import hashlib
import http.server
import subprocess
import threading
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from moorage.config import Config
from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.runtime.deploy_apt import AptInstallFailed, install, packages_of
from moorage.store import EntityKey, Scope
from tests.egress.test_vm_network import _env
from tests.runtime.conftest import Env, write_agent

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

MIRROR_HITS: list[str] = []

AGENT = """
async def on_message(ctx, message):
    r = await ctx.exec(["sh", "-c", "moorage-canary; dpkg-query -W -f='${Version}' moorage-canary"])
    return (r["stdout"] + r["stderr"]).strip() + VERSION
"""


def _deb(root: Path) -> Path:
    """A one-file Debian package, built with dpkg-deb: /usr/bin/moorage-canary prints a word."""
    pkg = root / "build"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "bin").mkdir(parents=True)
    script = pkg / "usr" / "bin" / "moorage-canary"
    script.write_text("#!/bin/sh\necho from-the-mirror\n")
    script.chmod(0o755)
    (pkg / "DEBIAN" / "control").write_text("Package: moorage-canary\nVersion: 1.0\nArchitecture: all\n"
                                            "Maintainer: moorage tests <tests@moorage.invalid>\n"
                                            "Description: a canary for apt at deploy time\n")
    out = root / "moorage-canary_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A Debian mirror on loopback: dists/bookworm/{Release, main/binary-amd64/Packages} and the pool."""
    root = tmp_path_factory.mktemp("mirror")
    debian = root / "debian"
    pool = debian / "pool" / "main" / "m" / "moorage-canary"
    pool.mkdir(parents=True)
    deb = _deb(root)
    data = deb.read_bytes()
    (pool / deb.name).write_bytes(data)
    control = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True).stdout
    packages = (control.rstrip("\n") + f"\nFilename: pool/main/m/moorage-canary/{deb.name}\nSize: {len(data)}\n"
                f"SHA256: {hashlib.sha256(data).hexdigest()}\n\n").encode()
    binary = debian / "dists" / "bookworm" / "main" / "binary-amd64"
    binary.mkdir(parents=True)
    (binary / "Packages").write_bytes(packages)
    (debian / "dists" / "bookworm" / "Release").write_text(
        "Origin: moorage-tests\nSuite: bookworm\nCodename: bookworm\nArchitectures: amd64 all\nComponents: main\n"
        "Date: Tue, 01 Dec 2026 00:00:00 UTC\nSHA256:\n"
        f" {hashlib.sha256(packages).hexdigest()} {len(packages)} main/binary-amd64/Packages\n")

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
