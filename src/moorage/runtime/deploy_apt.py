"""Debian packages at deploy time: ``[agent] apt = [...]`` installed into the template by apt-get, so every fork has them.

apt-get runs as root in the template's builder micro-VM, through the egress relay and gateway with the operator's
package-index policy only; the .deb files it fetched are kept on the host, keyed by what was asked and by the image's
installed packages, so redeploying an unchanged list downloads nothing.
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
from moorage.runtime.private_files import private_dir, write_private

log = get_logger(__name__)

DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Debian package names (policy §5.6.7); matched whole, so nothing else reaches apt-get's command line.
_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]{1,99}")
MAX_PACKAGES = 64
#: The largest set of downloaded .deb files kept in the cache.
MAX_CACHED_BYTES = 512 << 20
_DEBS = "/var/cache/apt/archives"


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


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(l for l in text.strip().splitlines()[-lines:])


def _out(r: Any) -> str:
    return r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


async def install(sandbox: Any, packages: list[str], config: Any, egress: Any, cache_dir: Path,
                  say: Callable[[str], None], owner: str = "", record: Any = None) -> str:
    """Install ``packages`` into ``sandbox`` (the template's builder); returns "cached" or "installed". Each
    request apt makes through the gateway is a span for ``record`` (the deploy's trace), if given.

    ``owner`` (the agent's id) is part of the cache key, as for pip's packages: what one agent's deploy fetched is
    reused for that agent only.
    """
    from moorage.egress import EgressDenied, Target
    from moorage.runtime.vm_network import PROXY_URL, attach_instance

    who = await sandbox.exec(["id", "-u"], timeout=30)
    if who.stdout.strip() != b"0":
        raise AptInstallFailed("Debian packages ([agent] apt) need the micro-VM driver: this sandbox does not run "
                               "as root inside", hint="deploy on a host whose sandbox_driver is microvm, or vendor "
                                                      "what the agent needs; nothing was changed")
    mirror = (config.package_apt_url or DEFAULT_MIRROR).rstrip("/")
    facts = await sandbox.exec(["sh", "-c", ". /etc/os-release; echo $VERSION_CODENAME; dpkg --print-architecture; "
                                            "sha256sum /var/lib/dpkg/status"], timeout=30)
    lines = facts.stdout.decode(errors="replace").split()
    if facts.exit_code != 0 or len(lines) < 3:
        raise AptInstallFailed("the sandbox's image has no Debian release information for apt",
                               hint="use the default guest image")
    codename, arch, status = lines[0], lines[1], lines[2]
    key = hashlib.sha256("\0".join([owner, " ".join(packages), mirror, str(bool(config.package_apt_trusted)),
                                    codename, arch, status]).encode()).hexdigest()
    cached = private_dir(cache_dir) / f"apt-{key}.tar"
    if cached.exists():
        say("Debian packages from the cache (list unchanged)")
        names = await _unpack_debs(sandbox, cached.read_bytes())
        r = await sandbox.exec(["dpkg", "-i", *names], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
        if r.exit_code == 0:
            await sandbox.exec(["rm", "-rf", "/tmp/moorage-debs"], timeout=30)
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
                               hint="check package_apt_url and egress_package_index, then deploy again; "
                                    "nothing was changed")
    r = await sandbox.exec(["apt-get", *opts, "install", "-y", "--no-install-recommends", *packages], env=env,
                           timeout=1800)
    if r.exit_code != 0:
        raise AptInstallFailed(f"apt-get could not install [agent] apt:\n{_tail(_out(r))}",
                               hint="fix the list in moorage.toml and deploy again; nothing was changed")
    data = await _pack_debs(sandbox)
    if data is not None:
        write_private(cached, data)
    # The template keeps the packages, not apt's downloads and lists (every fork would carry them).
    await sandbox.exec(["sh", "-c", "apt-get clean && rm -rf /var/lib/apt/lists/*"], timeout=120)
    return "installed"


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


async def _unpack_debs(sandbox: Any, data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile() and re.fullmatch(r"[A-Za-z0-9+.~%_-]+\.deb", m.name)]
    await sandbox.exec(["mkdir", "-p", "/tmp/moorage-debs"], timeout=30)
    await sandbox.write_file("/tmp/moorage-debs/debs.tar", data)
    await sandbox.exec(["tar", "xf", "/tmp/moorage-debs/debs.tar", "-C", "/tmp/moorage-debs"], timeout=300)
    return [f"/tmp/moorage-debs/{n}" for n in names]
