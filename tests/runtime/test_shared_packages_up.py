"""The documented way, end to end: `moorage up` on the process driver, `moorage deploy` of an agent whose
requirements.txt names a package (from a package index on loopback, admitted by the operator's settings), turns
of several users over HTTP. Every user's sandbox imports the package from the template, read-only, and holds no
copy of it (docs/sandbox.md, *A template's shared directories*), asleep and awake. Redeploys that change the packages
and the network reach the users who already have an instance (runtime/instance_update.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import pytest

from moorage.client.sync import Client
from moorage.devservices.fleet import LocalHost
from moorage.sandbox.process_fs import disk_usage
from tests.langgraph.wheelhouse import build_index, serve

ROOT = Path(__file__).resolve().parents[2]
MOORAGE = [sys.executable, "-m", "moorage.cli.main"]
AGENT_PY = '''
import os
from tabulate import tabulate


async def on_message(ctx, message):
    if message == "keep":
        ctx.files.write("keep.txt", "kept")
        return "kept"
    if message == "kept?":
        return ctx.files.read("keep.txt")
    if message == "where":
        import tabulate as t
        return t.__file__
    if message == "write":
        try:
            with open(os.path.join(os.path.dirname(__import__("tabulate").__file__), "x.txt"), "w") as f:
                f.write("x")
        except OSError as e:
            return type(e).__name__ + ": " + e.strerror
        return "written"
    return tabulate([[message, len(message)]], tablefmt="plain")
'''


def write_agent(base: Path) -> Path:
    """Agent ``tab``: its turn formats the message with ``tabulate``, from its requirements.txt."""
    agent = base / "tab"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "tab"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                                        'concurrency = "parallel"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    (agent / "requirements.txt").write_text("tabulate\n")
    return agent


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tab-index-") as root:
        build_index(Path(root), "tabulate", "sniffio")
        # 127.0.0.2: a loopback address a sandbox's pip reaches through its proxy (it goes direct to 127.0.0.1).
        for port in serve(Path(root), "127.0.0.2"):
            yield f"http://127.0.0.2:{port}"


def test_users_of_an_agent_with_packages_share_the_templates_copy(tmp_path: Path, index: str) -> None:
    data = tmp_path / "data"
    agent = write_agent(tmp_path)
    server = LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",
                                    "MOORAGE_EGRESS_PACKAGE_INDEX": index,
                                    "MOORAGE_PACKAGE_INDEX_URL": index + "/simple/"}, start_timeout_s=120)
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(server.port)}  # for the CLI
    try:
        d = subprocess.run([*MOORAGE, "deploy", str(agent)], env=env, capture_output=True, text=True, timeout=600,
                           cwd=ROOT)
        assert d.returncode == 0 and "deployed tab #1" in d.stdout, d.stdout + d.stderr
        with Client(server.url, server.key) as api:
            def say(user: str, text: str) -> str:
                return str(api.invoke("tab", text, user=user)["reply"])

            for user in ("ann", "bob", "cid"):
                assert say(user, "hello") == "hello  5"
            assert say("ann", "where") == "/work/.moorage/site/tabulate/__init__.py"
            assert say("ann", "write") == "OSError: Read-only file system"
            boxes = {b["scope"]: b["id"] for b in api.list_sandboxes(agent="tab")["data"]}
            for user in ("ann", "bob", "cid"):
                sandbox = data / "sandboxes" / boxes[f"user:tab/{user}"]
                meta = json.loads((sandbox / "meta.json").read_text())
                site = Path(meta["shared"]["dir"]) / "layer" / "work" / ".moorage" / "site"
                assert (site / "tabulate").is_dir()
                assert list((sandbox / "layer" / "work" / ".moorage" / "site").iterdir()) == []
                assert disk_usage(sandbox / "layer") < disk_usage(site)
            # Asleep and awake again, the package is still there.
            assert api.sandbox_action(boxes["user:tab/bob"], "sleep")["slept"] is True
            assert say("bob", "again") == "again  5"

            # A redeploy that adds a package reaches the users who have an instance (ann awake, bob asleep), not
            # only new ones: their sandboxes bind the new template's packages, keep their files, copy nothing.
            assert say("ann", "keep") == "kept"
            first = json.loads((data / "sandboxes" / boxes["user:tab/ann"] / "meta.json").read_text())["shared"]
            assert api.sandbox_action(boxes["user:tab/bob"], "sleep")["slept"] is True
            (agent / "requirements.txt").write_text("tabulate\nsniffio\n")
            (agent / "agent.py").write_text(AGENT_PY + SNIFFIO_PY)
            manifest = (agent / "moorage.toml").read_text()
            # ... and a network: its proxy settings reach the existing sandboxes' processes too.
            (agent / "moorage.toml").write_text(manifest.replace("[agent.lifecycle]", f'[agent.network]\nallow = ["{index}"]\n[agent.lifecycle]'))
            d = subprocess.run([*MOORAGE, "deploy", str(agent)], env=env, capture_output=True, text=True, timeout=600,
                               cwd=ROOT)
            assert d.returncode == 0 and "deployed tab #2" in d.stdout, d.stdout + d.stderr
            for user in ("ann", "bob", "dan"):
                assert say(user, "which") == "/work/.moorage/site/sniffio/__init__.py"
                assert say(user, "proxy") == "http://127.0.0.1:3128"
            assert say("ann", "kept?") == "kept"
            meta = json.loads((data / "sandboxes" / boxes["user:tab/ann"] / "meta.json").read_text())
            assert meta["shared"]["template"] != first["template"]
            assert not (Path(first["dir"]) / "children" / boxes["user:tab/ann"]).exists()
            assert list((data / "sandboxes" / boxes["user:tab/ann"] / "layer/work/.moorage/site").iterdir()) == []
            assert say("cid", "hello") == "hello  5"  # cid's first turn of #2 too (it was awake, idle)

            # And one that drops its requirements leaves them no packages to import. A turn of another of ann's
            # sessions (in parallel: the agent's concurrency), running on #2 when her first turn of #3 restarts the
            # sandbox, is waited for, not cut.
            with ThreadPoolExecutor(2) as pool:
                slow = pool.submit(lambda: str(api.invoke("tab", "slow", user="ann", session="other")["reply"]))
                _until(lambda: api.exec(boxes["user:tab/ann"], ["test", "-e", "/work/waiting"])["exit_code"] == 0)
                (agent / "requirements.txt").unlink()
                (agent / "agent.py").write_text(PLAIN_PY)
                (agent / "moorage.toml").write_text(manifest)
                d = subprocess.run([*MOORAGE, "deploy", str(agent)], env=env, capture_output=True, text=True,
                                   timeout=600, cwd=ROOT)
                assert d.returncode == 0 and "deployed tab #3" in d.stdout, d.stdout + d.stderr
                first = pool.submit(say, "ann", "packages")
                time.sleep(2)
                assert not first.done() and not slow.done()  # the change waits for the running turn
                assert api.exec(boxes["user:tab/ann"], ["touch", "/work/go"])["exit_code"] == 0
                assert slow.result(timeout=120) == "went"
                assert first.result(timeout=300) == "none"
            for user in ("ann", "bob"):
                assert say(user, "packages") == "none"
                assert say(user, "proxy") == ""
            assert "shared" not in json.loads((data / "sandboxes" / boxes["user:tab/ann"] / "meta.json").read_text())
            assert say("ann", "kept?") == "kept"
    finally:
        server.stop()


def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


SNIFFIO_PY = '''
import asyncio

_plain = on_message


async def on_message(ctx, message):
    import sniffio
    if message == "which":
        return sniffio.__file__
    if message == "proxy":
        return (await ctx.exec(["sh", "-c", "echo $HTTP_PROXY"]))["stdout"].strip()
    if message == "slow":  # runs until the test says go
        ctx.files.write("waiting", "1")
        for _ in range(1200):
            if os.path.exists("/work/go"):
                return "went"
            await asyncio.sleep(0.05)
        return "timed out"
    return await _plain(ctx, message)
'''

PLAIN_PY = '''
import importlib.util


async def on_message(ctx, message):
    if message == "kept?":
        return ctx.files.read("keep.txt")
    if message == "proxy":
        return (await ctx.exec(["sh", "-c", "echo $HTTP_PROXY"]))["stdout"].strip()
    return "none" if importlib.util.find_spec("tabulate") is None else "tabulate"
'''
