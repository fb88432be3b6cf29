"""Debian packages at deploy time: ``[agent] apt = [...]`` installed into the template by apt-get, so every fork has them.

apt-get runs as root in the template's builder micro-VM, through the egress relay and gateway with the operator's
package-index policy only; the .deb files it fetched are kept on the host, keyed by what was asked, so redeploying an
unchanged list downloads nothing. A redeploy that changed the list reaches users who already have a VM
(``update``, from ``instance_update``): the added packages from the same cache, the dropped ones purged.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path
from typing import Any, Callable, Mapping

from moorage.errors import InvalidInput
from moorage.log import get_logger
from moorage.runtime.deploy_packages import fetch_missing
from moorage.runtime.private_files import private_dir, write_private

log = get_logger(__name__)

DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Debian package names (policy §5.6.7); matched whole, so nothing else reaches apt-get's command line.
_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]{1,99}")
MAX_PACKAGES = 64
#: The largest set of downloaded .deb files kept in the cache.
MAX_CACHED_BYTES = 512 << 20
_DEBS = "/var/cache/apt/archives"
#: Written last, once the packages are installed: the list they came from, a name a line (``installed``), each
#: one the sandbox had before moorage installed anything for the list (its image's, one installed by hand) marked
#: ``=name``: a later list without it leaves it alone. An instance whose list differs from its deployment's gets
#: that deployment's (``update``).
MARKER = "/var/lib/moorage/apt-packages"


class AptInstallFailed(InvalidInput):
    """apt-get could not install the agent's Debian packages (the message ends with apt's own words)."""

    code = "agent-apt-packages"


def packages_of(manifest: Mapping[str, Any]) -> list[str]:
    """The ``apt`` list of an ``[agent]`` table, checked (sorted, without duplicates); [] when there is none."""
    raw = manifest.get("apt", [])
    hint = 'list Debian package names, e.g. apt = ["jq", "ffmpeg"]'
    if not isinstance(raw, list) or len(raw) > MAX_PACKAGES:
        raise AptInstallFailed(f"moorage.toml: [agent] apt must be a list of at most {MAX_PACKAGES} package names",
                               hint=hint)
    for name in raw:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise AptInstallFailed(f"moorage.toml: [agent] apt: {name!r} is not a Debian package name", hint=hint)
    return sorted(set(raw))


async def installed(sandbox: Any) -> list[str] | None:
    """The ``apt`` list the sandbox's Debian packages were installed from; None when it has no marker (a sandbox
    of a template with no list, or one made before markers were written)."""
    marked = await _marked(sandbox)
    return None if marked is None else sorted(marked)


async def _marked(sandbox: Any) -> dict[str, bool] | None:
    """The marker: each name of the list -> whether moorage installed it (False: the sandbox had it before)."""
    from moorage.sandbox import GuestFileNotFound

    try:
        data = await sandbox.read_file(MARKER, max_bytes=64 << 10)
    except GuestFileNotFound:
        return None
    return {w.lstrip("="): not w.startswith("=") for w in data.decode(errors="replace").split()
            if _NAME.fullmatch(w.lstrip("="))}


async def _mark(sandbox: Any, packages: list[str], ours: set[str]) -> None:
    await sandbox.exec(["mkdir", "-p", MARKER.rsplit("/", 1)[0]], timeout=30)
    await sandbox.write_file(MARKER, "".join(f"{'' if n in ours else '='}{n}\n" for n in packages).encode())


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(l for l in text.strip().splitlines()[-lines:])


def _out(r: Any) -> str:
    return r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


async def install(sandbox: Any, packages: list[str], config: Any, egress: Any, cache_dir: Path,
                  say: Callable[[str], None], owner: str = "", record: Any = None,
                  fetch: Callable[[str, Path], bool] | None = None,
                  kept: Callable[[str, Path], None] | None = None) -> str:
    """Install ``packages`` into ``sandbox`` (the template's builder, or an instance whose deployment's list
    changed: ``update``); returns "cached" or "installed". Each request apt makes through the gateway is a span for
    ``record`` (the deploy's trace), if given.

    ``owner`` (the agent's id) is part of the cache key, as for pip's packages: what one agent's deploy fetched is
    reused for that agent only. A fleet shares the entries as pip's (``deploy_packages.install``): ``fetch(key,
    dest)`` is asked for a missing one before apt runs, ``kept(key, path)`` hears of the one this host has after.
    """
    from moorage.egress import EgressDenied, Target
    from moorage.runtime.vm_network import PROXY_URL, attach_instance

    who = await sandbox.exec(["id", "-u"], timeout=30)
    if who.stdout.strip() != b"0":
        raise AptInstallFailed("Debian packages ([agent] apt) need the micro-VM driver: this sandbox does not run "
                               "as root inside", hint="deploy on a host whose sandbox_driver is microvm, or vendor "
                                                      "what the agent needs")
    mirror = (config.package_apt_url or DEFAULT_MIRROR).rstrip("/")
    # The release, and which names of the list the sandbox has already (one shell: each process costs under TCG).
    facts = await sandbox.exec(["sh", "-c", ". /etc/os-release; echo $VERSION_CODENAME; dpkg --print-architecture; "
                                            "dpkg-query -W -f='${db:Status-Abbrev}${Package}\\n' \"$@\" 2>/dev/null; true",
                                "sh", *packages], timeout=30)
    lines = facts.stdout.decode(errors="replace").split()
    if facts.exit_code != 0 or len(lines) < 2:
        raise AptInstallFailed("the sandbox's image has no Debian release information for apt",
                               hint="use the default guest image")
    codename, arch = lines[0], lines[1]
    had = {line[3:].split(":", 1)[0] for line in facts.stdout.decode(errors="replace").splitlines()[2:]
           if line.startswith("ii ")}
    # Moorage's: what an earlier list of moorage's installed, and what the sandbox does not have yet.
    prior = await _marked(sandbox) or {}
    ours = {n for n in packages if prior.get(n, n not in had)}
    # Not keyed by what the sandbox has installed: apt-get checks the cached set against it before it changes
    # anything (a dependency the set lacks, or a version older than the one installed, refuses the whole set, and
    # apt then downloads as below), and an instance whose list changed has other packages than the builder had.
    key = hashlib.sha256("\0".join([owner, " ".join(packages), mirror, str(bool(config.package_apt_trusted)),
                                    codename, arch]).encode()).hexdigest()
    cached = private_dir(cache_dir) / f"apt-{key}.tar"
    fetched = await fetch_missing(cached, key, fetch)
    if cached.exists():
        say("Debian packages from the template's published copy" if fetched
            else "Debian packages from the cache (list unchanged)")
        r = await _install_debs(sandbox, cached.read_bytes(), packages)
        await sandbox.exec(["rm", "-rf", "/tmp/moorage-debs"], timeout=30)
        if r.exit_code == 0:
            await _mark(sandbox, packages, ours)
            if kept is not None:
                kept(key, cached)
            return "cached"
        log.warning("apt cache entry unusable; installing again", key=key, error=_tail(_out(r), 2))

    # The mirror must be one the operator allows: said here, before apt turns a refusal into "403 Forbidden".
    inst = egress.instance({"network": {"packages": True}}, record=record)
    try:
        t = Target.parse(mirror + "/")
        decision = await egress.check(inst.policy, t)
        decision.raise_if_denied()
    except EgressDenied as e:
        raise AptInstallFailed(f"the Debian mirror {mirror} is not allowed: {e.message}",
                               hint="the operator lists package indexes in egress_package_index "
                                    "(and package_apt_url names the mirror apt uses)") from None
    attach_instance(sandbox.channel, inst, sandbox.id)
    say(f"installing Debian packages through the egress gateway ({mirror}): {' '.join(packages)}")
    trusted = "[trusted=yes] " if config.package_apt_trusted else ""
    await sandbox.write_file("/etc/apt/sources.list", f"deb {trusted}{mirror} {codename} main\n".encode())
    env = {"DEBIAN_FRONTEND": "noninteractive", "HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL,
           "http_proxy": PROXY_URL, "https_proxy": PROXY_URL}
    opts = ["-q", "-o", f"Acquire::http::Proxy={PROXY_URL}", "-o", f"Acquire::https::Proxy={PROXY_URL}",
            "-o", "Acquire::Languages=none"]
    r = await sandbox.exec(["apt-get", *opts, "update"], env=env, timeout=900)
    if r.exit_code != 0 or "Err:" in _out(r) or "W: Failed to fetch" in _out(r):
        raise AptInstallFailed(f"apt-get could not read the mirror {mirror}:\n{_tail(_out(r))}",
                               hint="check package_apt_url and egress_package_index, then deploy again")
    r = await sandbox.exec(["apt-get", *opts, "install", "-y", "--no-install-recommends", *packages], env=env,
                           timeout=1800)
    if r.exit_code != 0:
        raise AptInstallFailed(f"apt-get could not install [agent] apt:\n{_tail(_out(r))}",
                               hint="fix the list in moorage.toml and deploy again")
    data = await _pack_debs(sandbox)
    if data is not None:
        write_private(cached, data)
        if kept is not None:
            kept(key, cached)
    # The template keeps the packages, not apt's downloads and lists (every fork would carry them).
    await sandbox.exec(["sh", "-c", "apt-get clean && rm -rf /var/lib/apt/lists/*"], timeout=120)
    await _mark(sandbox, packages, ours)
    return "installed"


async def update(sandbox: Any, packages: list[str], config: Any, egress: Any, cache_dir: Path,
                 say: Callable[[str], None], owner: str = "",
                 fetch: Callable[[str, Path], bool] | None = None) -> str:
    """Make an instance's Debian packages those of ``packages`` (its deployment's list) where they were those of
    its marker: the list installed (``install``: from this host's cache, else through the gateway), then the ones
    moorage installed for the old list alone marked as installed automatically and removed with whatever they
    alone needed (``apt-get autoremove --purge``: a package still needed by one on the new list, or installed by
    hand, stays; one the sandbox had before any list is never removed). Returns what was done."""
    before = await _marked(sandbox) or {}
    how = (await install(sandbox, packages, config, egress, cache_dir, say, owner=owner, fetch=fetch)
           if packages else "none")
    dropped = sorted(n for n, ours in before.items() if ours and n not in packages)
    if dropped:
        say(f"removing Debian packages the list dropped: {' '.join(dropped)}")
        # Each name alone: one the agent already removed is not an error.
        r = await sandbox.exec(["sh", "-c", 'for p in "$@"; do apt-mark auto "$p" >/dev/null 2>&1; done; '
                                            "apt-get autoremove --purge -y -q", "sh", *dropped],
                               env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
        if r.exit_code != 0:
            raise AptInstallFailed(f"apt-get could not remove the packages [agent] apt dropped:\n{_tail(_out(r))}",
                                   hint="the turn can be retried; the next load tries again")
        how = f"{how}, removed {len(dropped)}"
    if not packages:
        await _mark(sandbox, [], set())
    return how


async def _pack_debs(sandbox: Any) -> bytes | None:
    r = await sandbox.exec(["sh", "-c", f"cd {_DEBS} && tar cf /tmp/moorage-debs.tar $(ls *.deb 2>/dev/null)"],
                           timeout=300)
    try:
        if r.exit_code != 0:
            return None
        return await sandbox.read_file("/tmp/moorage-debs.tar", max_bytes=MAX_CACHED_BYTES)
    except Exception as e:  # a set too large to cache is downloaded again next time, nothing worse
        log.info("downloaded Debian packages not cached", error=type(e).__name__)
        return None
    finally:
        await sandbox.exec(["rm", "-f", "/tmp/moorage-debs.tar"], timeout=30)


async def _install_debs(sandbox: Any, data: bytes, packages: list[str]) -> Any:
    """Install the cached .deb files: apt-get checks them first (a simulation, by path: they and what is installed
    must satisfy every dependency; nothing is changed when they do not), then dpkg installs the ones apt would
    (new or newer: none at all when the sandbox has them), which under TCG takes a quarter of apt-get's own run.
    New ones not on the list are marked installed automatically, as a download by name marks them, so that a later
    list without their package removes them too."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile() and re.fullmatch(r"[A-Za-z0-9+.~%_-]+\.deb", m.name)]
    await sandbox.exec(["mkdir", "-p", "/tmp/moorage-debs"], timeout=30)
    await sandbox.write_file("/tmp/moorage-debs/debs.tar", data)
    await sandbox.exec(["tar", "xf", "/tmp/moorage-debs/debs.tar", "-C", "/tmp/moorage-debs"], timeout=300)
    files = {n.split("_", 1)[0]: f"/tmp/moorage-debs/{n}" for n in names}
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    plan = await sandbox.exec(["apt-get", "install", "-s", "-q", "--no-install-recommends", *files.values()],
                              env=env, timeout=900)
    if plan.exit_code != 0:
        return plan
    # "Inst name (version ...)" installs, "Inst name [old] (version ...)" upgrades, "Remv name ..." removes.
    steps = [line.split() for line in plan.stdout.decode(errors="replace").splitlines()]
    inst = {s[1].split(":", 1)[0]: len(s) > 2 and s[2].startswith("[") for s in steps if len(s) > 1 and s[0] == "Inst"}
    if any(s and s[0] == "Remv" for s in steps) or not set(inst) <= set(files):
        # Something to remove, or to take from elsewhere: apt-get does it all (it checked it can).
        return await sandbox.exec(["apt-get", "install", "-y", "-q", "--no-install-recommends", *files.values()],
                                  env=env, timeout=900)
    if not inst:
        return plan
    r = await sandbox.exec(["dpkg", "-i", *[files[n] for n in sorted(inst)]], env=env, timeout=900)
    auto = sorted(n for n, upgrade in inst.items() if not upgrade and n not in packages)
    if r.exit_code == 0 and auto:
        await sandbox.exec(["apt-mark", "auto", *auto], timeout=60)
    return r
