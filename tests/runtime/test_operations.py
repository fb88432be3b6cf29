"""docs/operations.md, end to end on the process driver: `moorage up` stopped, its data directory copied with
`cp -a`, the copy started beside the original and then on "another machine" (another host id, the original gone).
Users wake where they stopped (files, facts, events), keys, end-user tokens and secrets still work, and the copy
never reads or writes the original's files (templates, the packages its users bind)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage.client.sync import Client
from moorage.devservices.fleet import LocalHost
from tests.langgraph.wheelhouse import build_index, serve

AGENT_PY = '''
import json
import os


async def on_message(ctx, message):
    if message == "marks":  # what of the original's files (planted after the copy) this sandbox sees
        return " ".join(p for p in ("/work/MARK", "/work/.moorage/site/MARK") if os.path.exists(p)) or "none"
    if message == "memory":  # semantic and episodic memory, as the agent sees them
        facts = [f["value"] for f in await ctx.memory.facts()]
        return f"{facts} {'said two' in json.dumps(await ctx.memory.recall('what was said second'))}"
    from tabulate import tabulate
    await ctx.memory.remember(f"said {message}")
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1} {os.environ.get('TOKEN', '<absent>')} {tabulate([[message]], tablefmt='plain')}"
'''


def _agent(base: Path) -> Path:
    d = base / "keep"
    d.mkdir(parents=True)
    (d / "moorage.toml").write_text('[agent]\nname = "keep"\nentry = "agent.py"\n[agent.secrets]\nenv = ["TOKEN"]\n'
                                    '[agent.lifecycle]\nusers = "auto"\n')
    (d / "agent.py").write_text(AGENT_PY)
    (d / "requirements.txt").write_text("tabulate\n")
    return d


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ops-index-") as root:
        build_index(Path(root), "tabulate")
        for port in serve(Path(root), "127.0.0.2"):  # 127.0.0.2: reached by the sandbox's pip through its proxy
            yield f"http://127.0.0.2:{port}"


def _env(index: str) -> dict[str, str]:
    return {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",
            "MOORAGE_EGRESS_PACKAGE_INDEX": index, "MOORAGE_PACKAGE_INDEX_URL": index + "/simple/"}


def _tree(d: Path) -> dict[str, float]:
    return {str(p.relative_to(d)): p.lstat().st_mtime for p in d.rglob("*")}


def _user_turn(url: str, token: str, text: str) -> httpx.Response:
    """A turn with an end-user token (the user is the token's)."""
    return httpx.post(f"{url}/v1/agents/keep/invoke", json={"message": text},
                      headers={"Authorization": f"Bearer {token}"}, timeout=300)


def test_a_stopped_hosts_copy_serves_where_it_stopped_and_never_touches_the_original(tmp_path: Path, index: str) -> None:
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    host = LocalHost("box", a, _env(index), start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("keep", _agent(tmp_path / "agents"))
            sdk.set_secret("keep", "TOKEN", "s3cret")
            assert sdk.invoke("keep", "one", user="ada")["reply"] == "1 s3cret one"
            assert sdk.invoke("keep", "two", user="ada")["reply"] == "2 s3cret two"
            sdk.add_fact("keep", "ada", "ada", "drinks", "green tea")
            token = sdk.issue_user_token("keep", "ada", ttl_s=3600)["token"]
            reader = sdk.create_key(["read"], label="backup-check")["secret"]
    finally:
        host.stop()  # SIGTERM: ada's sandbox sleeps

    # The documented backup: the whole data directory, copied with the host stopped.
    b.parent.mkdir()
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)
    # From now on the original's template is not the copy's: what the copy's sandboxes would see of it is marked.
    (tpl,) = [p for p in (a / "sandboxes" / ".templates").iterdir() if (p / "template.json").exists()]
    (tpl / "layer" / "work" / "MARK").write_text("original")
    site = tpl / "layer" / "work" / ".moorage" / "site"
    os.chmod(site, 0o755)
    (site / "MARK").write_text("original")
    before = _tree(a / "sandboxes")

    # Beside the original, both running on this machine.
    original = LocalHost("box", a, _env(index), start_timeout_s=120)
    copy = LocalHost("box", b, _env(index), start_timeout_s=120)
    try:
        with Client(copy.url, copy.key) as sdk:
            assert sdk.invoke("keep", "three", user="ada")["reply"] == "3 s3cret three"
            assert sdk.invoke("keep", "marks", user="ada")["reply"] == "none"
            assert sdk.invoke("keep", "hi", user="bob")["reply"] == "1 s3cret hi"  # a new user of the copy
            assert sdk.invoke("keep", "marks", user="bob")["reply"] == "none"
        with Client(original.url, original.key) as sdk:  # the original goes on from where it was, on its own
            assert sdk.invoke("keep", "three", user="ada")["reply"] == "3 s3cret three"
    finally:
        copy.stop()
        original.stop()
    after = _tree(a / "sandboxes")
    # The original's own turn changed its sandbox; nothing of the copy's users appeared in the original.
    bob = [p for p in after if p not in before and "children" in p]
    assert not bob, bob

    # Moved to another machine: the original is gone and the host has another name.
    shutil.move(str(a.parent), str(tmp_path / "gone"))
    moved = LocalHost("elsewhere", b, _env(index), start_timeout_s=120)
    try:
        with Client(moved.url, moved.key) as sdk:
            assert sdk.invoke("keep", "four", user="ada")["reply"] == "4 s3cret four"
            assert sdk.invoke("keep", "again", user="bob")["reply"] == "2 s3cret again"
            assert sdk.invoke("keep", "hi", user="cy")["reply"] == "1 s3cret hi"
            facts = sdk.list_facts("keep", "ada")["data"]
            assert [(f["attribute"], f["value"]) for f in facts] == [("drinks", "green tea")]
            assert "said two" in json.dumps(sdk.list_events("keep", "ada")["data"])  # from before the backup
            assert sdk.invoke("keep", "memory", user="ada")["reply"] == "['green tea'] True"
        r = _user_turn(moved.url, token, "five")
        assert r.status_code == 200 and r.json()["reply"] == "5 s3cret five", r.text
        with Client(moved.url, reader) as sdk:
            assert [a["name"] for a in sdk.list_agents()["data"]] == ["keep"]
    finally:
        moved.stop()


VM_AGENT_PY = '''
SEEN = 0  # in the guest's memory only: it goes on counting only if the VM's RAM was restored


async def on_message(ctx, message):
    global SEEN
    SEEN += 1
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1} {SEEN}"
'''



def test_a_copy_taken_while_the_host_runs_never_stops_the_originals_sandboxes(tmp_path: Path) -> None:
    """Not the documented backup (docs/operations.md says why), but what an operator may well do: the copy, started
    beside the original on this machine, finds its users recorded awake with the original's process ids. It must
    not take those processes for its own (attach to them, or kill them as unresponsive)."""
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    agent = tmp_path / "agents" / "echo"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(VM_AGENT_PY)
    original = LocalHost("box", a, {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(original.url, original.key) as sdk:
            sdk.deploy("echo", agent)
            assert sdk.invoke("echo", "one", user="ada")["reply"] == "1 1"
            b.parent.mkdir()
            _copy_while_it_serves(a, b)
            copy = LocalHost("box", b, {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
            try:
                with Client(copy.url, copy.key) as other:
                    assert other.invoke("echo", "two", user="ada")["reply"] == "2 1"  # from its copy of the files
            finally:
                copy.stop()
            assert sdk.invoke("echo", "two", user="ada")["reply"] == "2 2"  # the same process, its memory whole
    finally:
        original.stop()


def _copy_while_it_serves(a: Path, b: Path) -> None:
    """``cp -a`` as an operator runs it beside a serving host: a file the host removes meanwhile (a checkpoint's
    written-behind copy, settled after the turn) fails the copy, and the operator runs it again."""
    for _ in range(5):
        done = subprocess.run(["cp", "-a", str(a), str(b)], capture_output=True, text=True)
        if done.returncode == 0:
            return
        assert "No such file or directory" in done.stderr, done.stderr
        shutil.rmtree(b)
        time.sleep(0.5)
    raise AssertionError(f"cp -a failed five times: {done.stderr}")


def _names(root: Path, old: str) -> list[str]:
    """Files under ``root`` whose metadata or qcow2 header names a path under ``old``."""
    from moorage.sandbox.microvm_files import qcow2_backing

    out = []
    for p in root.rglob("*"):
        if p.name in ("meta.json", "template.json") and old in p.read_text():
            out.append(str(p))
        elif p.suffix == ".qcow2" and old in (qcow2_backing(p) or ""):
            out.append(f"{p} -> {qcow2_backing(p)}")
    return out


def _booted(data: Path) -> set[str]:
    """The booted templates' ids the records of a data directory name (runtime/booted.py)."""
    return {json.loads(p.read_text())["template"]["id"] for p in (data / "templates" / "booted").glob("*.json")}


@pytest.mark.slow
def test_a_sleeping_vm_restored_at_another_path_wakes_with_its_memory(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    images = os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")
    env = {"MOORAGE_TEST_IMAGES_DIR": images, "MOORAGE_LOG_LEVEL": "warning"}
    agent = tmp_path / "agents" / "echo"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (agent / "agent.py").write_text(VM_AGENT_PY)
    host = LocalHost("box", a, env, driver="microvm")
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", agent)
            assert sdk.invoke("echo", "one", user="ada")["reply"] == "1 1"
            assert sdk.invoke("echo", "two", user="ada")["reply"] == "2 2"
    finally:
        host.stop()  # SIGTERM: ada's VM sleeps, its RAM in its snapshot

    b.parent.mkdir()
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)
    moved = LocalHost("elsewhere", b, env, driver="microvm")  # beside the original, as if on another machine
    try:
        with Client(moved.url, moved.key) as sdk:
            assert sdk.invoke("echo", "three", user="ada")["reply"] == "3 3"  # files and memory
            boxes = {s["scope"]: s for s in sdk.list_sandboxes(agent="echo")["data"]}
            assert boxes["user:echo/ada"]["wake_kind"] == "snapshot"
            assert sdk.invoke("echo", "hi", user="bob")["reply"] == "1 1"  # forked from the copy's template
            # A redeploy's builder resumes the booted template the original kept (docs/sandbox.md), made the copy's.
            (agent / "agent.py").write_text(VM_AGENT_PY + "\n# redeployed on the copy\n")
            sdk.deploy("echo", agent)
            assert sdk.invoke("echo", "hi", user="carol")["reply"] == "1 1"
    finally:
        moved.stop()
    # Resumed, not booted: a booted template the copy could not use would have been replaced by another.
    assert _booted(b) == _booted(a) and len(_booted(b)) == 1
    assert _names(b, str(a)) == []  # the copy no longer names any file of the original
    shutil.move(str(a.parent), str(tmp_path / "gone"))  # which may go: the copy starts without it below

    # An upgrade of QEMU (the Debian package): every snapshot and the template were saved by another build.
    for f in [*b.glob("sandboxes/*/meta.json"), *b.glob("sandboxes/.templates/*/template.json")]:
        record = json.loads(f.read_text())
        if record.get("snapshot"):
            record["snapshot"]["qemu"] = "QEMU emulator version 7.0.0 [an older build]"
            f.write_text(json.dumps(record))
    upgraded = LocalHost("elsewhere", b, env, driver="microvm")
    try:
        with Client(upgraded.url, upgraded.key) as sdk:
            assert sdk.invoke("echo", "four", user="ada")["reply"] == "4 1"  # files kept, processes started anew
            boxes = {s["scope"]: s for s in sdk.list_sandboxes(agent="echo")["data"]}
            assert boxes["user:echo/ada"]["wake_kind"] == "cold-fallback"
            assert sdk.invoke("echo", "hi", user="cy")["reply"] == "1 1"  # from a template made again
            boxes = {s["scope"]: s for s in sdk.list_sandboxes(agent="echo")["data"]}
            assert boxes["user:echo/cy"]["wake_kind"] == "fork"
    finally:
        upgraded.stop()
    assert "cannot be forked on this host any more" in upgraded.log.read_text()
