"""Packages at deploy time: an agent's ``requirements.txt`` installed into its template, so every fork has them.

pip runs in the template's builder sandbox, through the egress gateway with the operator's package-index
policy only (``egress_package_index``); what it installed is kept on the host, keyed by the hash of what was
asked (requirements, index, guest Python), so redeploying unchanged requirements installs nothing again.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

from moorage.errors import InvalidInput
from moorage.log import get_logger
from moorage.runtime.private_files import private_dir, write_private

log = get_logger(__name__)

REQUIREMENTS = "requirements.txt"
#: Where the packages live inside the sandbox (on its disk: forks, sleep and wake keep them); on PYTHONPATH.
SITE_DIR = "/work/.moorage/site"
#: Written there last, once the packages are complete: the digest of the requirements they came from (``digest``).
#: An instance whose marker differs from its deployment's gets that deployment's packages (instance_update.py).
MARKER = SITE_DIR + "/.moorage-requirements"
#: The largest requirements.txt accepted, and the largest installed tree kept in the cache.
MAX_REQUIREMENTS_BYTES = 64 << 10
MAX_CACHED_BYTES = 256 << 20
#: pip's scratch space, on the sandbox's disk beside SITE_DIR: ``--target`` stages the whole tree and then moves
#: it into place, a rename on one filesystem; in the guest's /tmp (a tmpfs) it was a copy, and the tree and the
#: downloaded wheels sat in the VM's memory meanwhile (a tree near the VM's size could not be installed).
PIP_TMP = "/work/.moorage/pip-tmp"


class PackageInstallFailed(InvalidInput):
    """pip could not install the agent's requirements (the message ends with pip's own words)."""

    code = "agent-packages"


def requirements_of(files: Mapping[str, bytes]) -> bytes | None:
    data = files.get(REQUIREMENTS)
    if data is not None and len(data) > MAX_REQUIREMENTS_BYTES:
        raise PackageInstallFailed(f"{REQUIREMENTS} is over {MAX_REQUIREMENTS_BYTES >> 10} KiB")
    return data


def digest(requirements: bytes | None) -> str:
    """What an instance's packages are compared by: the hash of the requirements asked for ("" for none)."""
    return hashlib.sha256(requirements).hexdigest() if requirements else ""


def guest_env(requirements: bytes | None) -> dict[str, str]:
    """What a template with packages needs in every process: the packages on the path, its relay on."""
    if not requirements:
        return {}
    return {"PYTHONPATH": SITE_DIR, "MOORAGE_NETWORK": "1"}


async def fetch_missing(cached: Path, key: str, fetch: Callable[[str, Path], bool] | None) -> bool:
    """A fleet's copy of cache entry ``key`` into ``cached`` when this host lacks it (``fetch``, blocking); returns
    whether it came. An object store that fails is logged: the caller installs from the index instead."""
    if cached.exists() or fetch is None:
        return False
    try:
        return await asyncio.to_thread(fetch, key, cached)
    except Exception as e:  # noqa: BLE001 - the object store failed: installed from the index instead
        log.warning("published packages not fetched; installing", key=key, error=str(e))
        return False


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(l for l in text.strip().splitlines()[-lines:])


async def install(sandbox: Any, requirements: bytes, config: Any, egress: Any, cache_dir: Path,
                  say: Callable[[str], None], owner: str = "", record: Any = None,
                  fetch: Callable[[str, Path], bool] | None = None,
                  kept: Callable[[str, Path], None] | None = None) -> str:
    """Install ``requirements`` into ``sandbox`` (the template's builder, or an instance whose deployment's packages
    changed); returns "cached" or "installed". Each request pip makes through the gateway is a span for ``record``
    (the deploy's trace), if given.

    ``owner`` (the agent's id) is part of the cache key: an installed tree came out of a sandbox that ran the
    packages' own build code, so it is reused for the agent that asked for it, never handed to another. A fleet
    shares the entries (``fleet/templates.py``, beside the template): ``fetch(key, dest)`` is asked for a missing
    one before pip runs (blocking; returns whether it brought it), and ``kept(key, path)`` hears of the one this
    host has afterwards.
    """
    from moorage.egress import EgressDenied, Target
    from moorage.runtime.vm_network import PROXY_URL, attach_instance

    index = config.package_index_url or "https://pypi.org/simple/"
    py = await sandbox.exec(["python3", "-c", "import sys, sysconfig; print(sys.version, sysconfig.get_platform())"],
                            timeout=30)
    key = hashlib.sha256(b"\0".join([owner.encode(), requirements, index.encode(), py.stdout.strip()])).hexdigest()
    cached = private_dir(cache_dir) / f"{key}.tar.gz"
    await sandbox.exec(["mkdir", "-p", SITE_DIR], timeout=30)
    fetched = await fetch_missing(cached, key, fetch)
    if cached.exists():
        say("packages from the template's published copy" if fetched else "packages from the cache (requirements unchanged)")
        await sandbox.write_file("/tmp/moorage-site.tar.gz", cached.read_bytes())
        r = await sandbox.exec(["tar", "xzf", "/tmp/moorage-site.tar.gz", "-C", SITE_DIR], timeout=300)
        if r.exit_code == 0:
            await sandbox.exec(["rm", "-f", "/tmp/moorage-site.tar.gz"], timeout=30)
            await sandbox.write_file(MARKER, digest(requirements).encode())
            if kept is not None:
                kept(key, cached)
            return "cached"
        log.warning("package cache entry unusable; installing again", key=key)

    # The index must be one the operator allows: said here, before pip turns a refusal into "no versions".
    inst = egress.instance({"network": {"packages": True}}, record=record)
    try:
        t = Target.parse(index)
        decision = await egress.check(inst.policy, t)
        decision.raise_if_denied()
    except EgressDenied as e:
        raise PackageInstallFailed(f"the package index {index} is not allowed: {e.message}",
                                   hint="the operator lists package indexes in egress_package_index "
                                        "(and package_index_url names the one pip uses)") from None
    attach_instance(sandbox.channel, inst, sandbox.id)
    say(f"installing {REQUIREMENTS} through the egress gateway ({index})")
    await sandbox.write_file("/tmp/moorage-requirements.txt", requirements)
    await sandbox.exec(["mkdir", "-p", PIP_TMP], timeout=30)
    # pip compiles every module it installs (LangGraph's 1,340: ~30 s under TCG): kept, since micro-VM guests run with
    # PYTHONDONTWRITEBYTECODE and would otherwise compile every import again in every new process.
    argv = ["python3", "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--no-input",
            "--target", SITE_DIR, "--index-url", index, "-r", "/tmp/moorage-requirements.txt"]
    if t.scheme == "http":
        argv[-2:-2] = ["--trusted-host", t.host]
    env = {"HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL, "http_proxy": PROXY_URL, "https_proxy": PROXY_URL,
           "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1", "TMPDIR": PIP_TMP}
    r = await sandbox.exec(argv, env=env, timeout=900)
    await sandbox.exec(["rm", "-rf", PIP_TMP], timeout=120)
    if r.exit_code != 0:
        raise PackageInstallFailed(f"pip could not install {REQUIREMENTS}:\n"
                                   f"{_tail(r.stdout.decode(errors='replace') + r.stderr.decode(errors='replace'))}",
                                   hint=f"fix {REQUIREMENTS} (or ask the operator to allow its index) and deploy again")
    # gzip -1: the default level takes three times as long (seconds under TCG) for an entry 13% smaller.
    r = await sandbox.exec(["tar", "-I", "gzip -1", "-cf", "/tmp/moorage-site.tar.gz", "-C", SITE_DIR, "."],
                           timeout=300)
    if r.exit_code == 0:
        try:
            data = await sandbox.read_file("/tmp/moorage-site.tar.gz", max_bytes=MAX_CACHED_BYTES)
            write_private(cached, data)
            if kept is not None:
                kept(key, cached)
        except Exception as e:  # a tree too large to cache is installed again next time, nothing worse
            log.info("installed packages not cached", error=type(e).__name__)
        await sandbox.exec(["rm", "-f", "/tmp/moorage-site.tar.gz"], timeout=30)
    await sandbox.write_file(MARKER, digest(requirements).encode())
    return "installed"
