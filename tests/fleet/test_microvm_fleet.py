"""Micro-VM instances move between hosts: host A builds and publishes the deployment's template, a user's VM sleeps
there (shipped), and host B, with its own data directory and no template, wakes it from the object store.

B fetches A's template (not a rebuild: the instance's RAM delta and disk overlay are only valid against it), so the
wake restores memory (a counter kept by the agent's process continues) as well as files; B's copies name B's paths
only (A's data directory is gone by then), and a new user on B forks the same fetched template. Then B, with the
VM awake, dies: a third host wakes it from the copy shipped while it ran, its memory of that instant included.
Last, a fourth host on an upgraded QEMU cannot fork the published template: it builds and claims its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost, fleet_env
from moorage.store import open_store

IMAGES = os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")

AGENT_PY = '''\
COUNT = 0  # lives in the guest's agent process: kept across a snapshot wake, gone after a cold boot


async def on_message(ctx, message):
    global COUNT
    COUNT += 1
    if message.startswith("write "):
        ctx.files.write("note.txt", message[len("write "):])
    try:
        note = ctx.files.read("note.txt")
    except Exception:
        note = "-"
    return f"{COUNT}|{note}"
'''


def _agent(base: Path) -> Path:
    d = base / "agent-src"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (d / "agent.py").write_text(AGENT_PY)
    return d


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"vmfleet-{tmp_path.name}")


class Hosts:
    def __init__(self, base: Path, store_url: str, s3: dict[str, str]) -> None:
        self.base, self.store_url = base, store_url
        self.env = {**fleet_env(store_url, s3, lease_ttl_s="8", heartbeat_s="2"), "MOORAGE_TEST_IMAGES_DIR": IMAGES}
        self.up: dict[str, LocalHost] = {}
        self.key: str | None = None

    def start(self, name: str, env: dict[str, str] | None = None) -> httpx.Client:
        h = LocalHost(name, self.base / name, {**self.env, **(env or {})}, driver="microvm", start_timeout_s=900)
        self.up[name] = h
        self.key = self.key or h.key
        return h.client(self.key)

    def record(self, user: str) -> Any:
        store = open_store(Config(store_url=self.store_url))
        try:
            (rec,) = [r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=1000) if r.scope.user == user]
            return rec
        finally:
            store.close()

    def close(self) -> None:
        for h in self.up.values():
            h.stop()


@pytest.fixture
def hosts(tmp_path: Path, pg_url: str, s3: dict[str, str]) -> Iterator[Hosts]:
    h = Hosts(tmp_path, pg_url, s3)
    yield h
    h.close()


def _turn(api: httpx.Client, user: str, text: str) -> str:
    r = api.post("/v1/agents/echo/invoke", json={"message": text, "user": user})
    assert r.status_code == 200, r.text
    return r.json()["reply"]


def _backing(disk: Path) -> str:
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(disk)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["backing-filename"]


def test_a_sleeping_vm_wakes_on_a_host_without_its_template_with_memory_and_files(
        hosts: Hosts, tmp_path: Path, upgraded_qemu: Path) -> None:
    a = hosts.start("h1")
    # Every host shares the first host's admin key (one PostgreSQL store): the tenant and its key are fleet-wide.
    # Deployed twice: the second build resumes the sandbox the first one booted (runtime/booted.py), and that
    # template is the one published, fetched and forked by the other hosts below.
    first = _agent(tmp_path / "first")
    (first / "agent.py").write_text(AGENT_PY + "\n# the first deployment\n")
    for src in (first, _agent(tmp_path)):
        r = a.post("/v1/agents/echo/deployments", content=tar_dir(src), headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
    assert "resumed this host's booted sandbox" in (tmp_path / "h1.log").read_text(errors="replace")
    assert _turn(a, "u1", "write from A") == "1|from A"
    assert _turn(a, "u1", "again") == "2|from A"
    rec = hosts.record("u1")
    assert rec.host == "h1"
    template_id = json.loads((tmp_path / "h1" / "sandboxes" / rec.id / "meta.json").read_text())["template_id"]
    r = a.post(f"/v1/sandboxes/{rec.id}/sleep")
    assert r.status_code == 200 and r.json()["slept"] is True, r.text
    assert hosts.record("u1").meta.get("shipped_current")
    # Host A goes away with its disk: nothing B uses may still point into it.
    a.close()
    hosts.up.pop("h1").stop()
    os.rename(tmp_path / "h1", tmp_path / "h1-gone")

    b = hosts.start("h2")
    # The memory of the agent's process came back (3, not 1 after a cold boot) and so did its file.
    assert _turn(b, "u1", "again") == "3|from A"
    rec = hosts.record("u1")
    assert rec.host == "h2" and rec.meta["resumed_from"]["from"] == "shipped"
    assert rec.meta["wake_kind"] == "snapshot"
    sbx = tmp_path / "h2" / "sandboxes"
    tdir = sbx / ".templates" / template_id
    assert (tdir / "template.json").exists()  # A's template, fetched under its id (not rebuilt)
    meta = json.loads((sbx / rec.id / "meta.json").read_text())
    assert meta["template_dir"] == str(tdir)
    assert _backing(sbx / rec.id / "disk.qcow2") == str(tdir / "disk.qcow2")
    gone = str(tmp_path / "h1") + "/"
    assert gone not in json.dumps(meta) and gone not in _backing(tdir / "disk.qcow2")
    assert gone not in (tdir / "template.json").read_text()
    # A new user on B forks the same fetched template: no template was built on B.
    assert _turn(b, "u2", "write from B") == "1|from B"
    assert sorted(p.name for p in (sbx / ".templates").iterdir() if not p.name.startswith(".")) == [template_id]
    log = (tmp_path / "h2.log").read_text(errors="replace")
    assert "starting a sandbox for the template" not in log
    assert _turn(b, "u1", "again") == "4|from A"

    # Awake on B, the VM is shipped after its turns (paused for the copy, a memory snapshot of that instant with it).
    assert _turn(b, "u1", "write on B") == "5|on B"
    after = time.time()
    deadline = time.time() + 120
    while not (hosts.record("u1").meta.get("shipped") or {}).get("at", 0) > after:
        assert time.time() < deadline, hosts.record("u1").meta
        time.sleep(0.5)
    assert hosts.record("u1").meta["shipped"]["awake"] is True
    # B dies with its VMs; a third host takes the user over once B's lease lapsed, from that copy: memory included.
    b.close()
    hosts.up["h2"].kill()
    c = hosts.start("h3")
    deadline = time.time() + 120
    while True:
        r = c.post("/v1/agents/echo/invoke", json={"message": "again", "user": "u1"})
        if r.status_code == 200:
            break
        assert time.time() < deadline, r.text
        time.sleep(1)
    assert r.json()["reply"] == "6|on B"
    rec = hosts.record("u1")
    assert rec.host == "h3" and rec.meta["wake_kind"] == "snapshot" and rec.meta["resumed_from"]["from"] == "shipped"
    c.close()

    # A QEMU upgrade reaches one host first (a rolling upgrade). The published template's memory was saved by the
    # old build, which the new one cannot load: every new user there was a 503 until someone redeployed. Now the
    # host builds the template with its own QEMU and its claim replaces the old one, so hosts on the new build fork
    # it instead of each building their own. (A copy of the binary is another build to moorage: its mtime differs.)
    d = hosts.start("h4", {"PATH": f"{upgraded_qemu}:{os.environ['PATH']}"})
    assert _turn(d, "u3", "write on the new build") == "1|on the new build"
    rec = hosts.record("u3")
    assert rec.host == "h4" and rec.meta["wake_kind"] == "fork"
    rebuilt = json.loads((tmp_path / "h4" / "sandboxes" / rec.id / "meta.json").read_text())["template_id"]
    assert rebuilt != template_id
    log = (tmp_path / "h4.log").read_text(errors="replace")
    assert "cannot be forked on this host" in log and "claimed ours" in log
    d.close()


@pytest.fixture
def upgraded_qemu() -> Iterator[Path]:
    """A folder holding a copy of this machine's QEMU: the same code, but a build moorage has not seen. Debian's
    QEMU finds its firmware and modules relative to its binary (``../share``, ``../lib``): they come along. Outside
    the test's private temporary folder: QEMU loads modules after dropping to its unprivileged user."""
    d = Path(tempfile.mkdtemp(prefix="moorage-qemu-upgraded-", dir="/var/tmp"))
    try:
        d.chmod(0o755)
        (d / "bin").mkdir()
        exe = shutil.which("qemu-system-x86_64")
        assert exe is not None
        shutil.copy(exe, d / "bin" / "qemu-system-x86_64")
        for name in ("share", "lib"):
            (d / name).symlink_to(Path(exe).resolve().parent.parent / name)
        yield d / "bin"
    finally:
        shutil.rmtree(d, ignore_errors=True)
