"""A host whose agent is redeployed with other packages, again and again (a pin bumped every day), keeps only the
installed packages a template on its disk was made with: each requirements.txt an agent was ever deployed with left
its installed tree (tens of MiB for a real one) in ``templates/package-cache/`` for good. Through `moorage up`
(process driver), a package index on loopback and the template collector's own loop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from moorage.cli.up import tar_dir
from moorage.client.sync import Client
from moorage.devservices.fleet import LocalHost
from tests.langgraph.wheelhouse import build_index, serve

AGENT_PY = '''
import importlib.util


async def on_message(ctx, message):
    return ",".join(m for m in ("tabulate", "sniffio") if importlib.util.find_spec(m) is not None)
'''


def agent(base: Path, requirements: str) -> bytes:
    d = base / f"tab-{len(list(base.glob('tab-*')))}"
    d.mkdir(parents=True)
    (d / "moorage.toml").write_text('[agent]\nname = "tab"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (d / "agent.py").write_text(AGENT_PY)
    (d / "requirements.txt").write_text(requirements)
    return tar_dir(d)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("tab-index")
    build_index(root, "tabulate", "sniffio")
    # 127.0.0.2: a loopback address a sandbox's pip reaches through its proxy (it goes direct to 127.0.0.1).
    for port in serve(root, "127.0.0.2"):
        yield f"http://127.0.0.2:{port}"


def _until(check: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_packages_of_replaced_deployments_leave_the_cache(tmp_path: Path, index: str) -> None:
    data = tmp_path / "data"
    server = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "info", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",
                                    "MOORAGE_EGRESS_PACKAGE_INDEX": index,
                                    "MOORAGE_PACKAGE_INDEX_URL": index + "/simple/",
                                    # The collector every second, for templates replaced 2 s ago or more.
                                    "MOORAGE_TEMPLATE_GC_INTERVAL_S": "1", "MOORAGE_TEMPLATE_GC_GRACE_S": "2"},
                       start_timeout_s=120)
    templates = data / "templates"
    cache = templates / "package-cache"

    def entries() -> set[str]:
        return {p.name for p in cache.iterdir()} if cache.is_dir() else set()

    try:
        with Client(server.url, server.key) as api:
            d1 = api.deploy("tab", agent(tmp_path, "tabulate\n"))
            assert api.invoke("tab", "hi", user="ann")["reply"] == "tabulate"
            first = entries()
            assert len(first) == 1
            d2 = api.deploy("tab", agent(tmp_path, "tabulate\nsniffio\n"))
            d3 = api.deploy("tab", agent(tmp_path, "sniffio\n"))
            assert api.invoke("tab", "hi", user="bob")["reply"] == "sniffio"
            # The replaced deployments' templates go (they did before), and now their installed packages too.
            _until(lambda: not (templates / f"{d1['id']}.json").exists()
                   and not (templates / f"{d2['id']}.json").exists(), "the replaced templates to be collected")
            _until(lambda: len(entries()) == 1, "the package cache to keep only the live deployment's")
            live = entries()
            assert not live & first
            # ann's instance (made on #1) runs on, on #3's packages; a new user too.
            assert api.invoke("tab", "hi", user="ann")["reply"] == "sniffio"
            assert api.invoke("tab", "hi", user="cid")["reply"] == "sniffio"
            time.sleep(3)  # the collector ran a few times more: the live deployment's entry stays
            assert entries() == live and (templates / f"{d3['id']}.json").exists()
            # A rollback to #1 installs its packages again (from the index) and runs them.
            api.rollback("tab", d1["number"])
            assert api.invoke("tab", "hi", user="dan")["reply"] == "tabulate"
            # Its packages are in the cache again; #3's entry, no longer live, may already be collected (2 s grace).
            assert len(entries() - live) == 1
    finally:
        server.stop()
