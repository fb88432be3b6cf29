"""The path a user takes, on the microvm driver: `moorage up` as a process, HTTP with the official `openai` client.

New users come up from the template's snapshot (never a cold boot), the warm pool hands out pre-forked instances,
an echo agent's file counter survives sleep/wake, redeploy, a clean stop and start, and a detached stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.store import open_store
from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]
AGENT_PY = '''\
PREFIX = "{prefix}"

async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{{PREFIX}}{{n + 1}}: {{message}}"
'''


def _agent(base: Path, prefix: str = "", pool: int = 1) -> Path:
    d = base / f"echo-{prefix or 'v1'}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n'
                                    f'[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\npool = {pool}\n')
    (d / "agent.py").write_text(AGENT_PY.format(prefix=prefix))
    return d


class Up:
    """One `moorage up` process on a data dir (microvm driver, guest images shared with the other tests), on a port
    the kernel picks."""

    started = 0  # hosts started by this test process: each its own log

    def __init__(self, data: Path, *args: str) -> None:
        self.data = data
        images = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
        images.mkdir(parents=True, exist_ok=True)
        data.mkdir(parents=True, exist_ok=True)
        if not (data / "images").exists():
            (data / "images").symlink_to(images)
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": "0",
               "MOORAGE_SANDBOX_DRIVER": "microvm", "MOORAGE_LOG_LEVEL": "info"}
        Up.started += 1
        self.log = data.parent / f"up-{Up.started}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up", *args], env=env, cwd=ROOT,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        # The first start on a machine builds the guest image.
        self.url = wait_serving(self.proc, data, timeout=900, output=lambda: self.log.read_text(errors="replace"))
        self.key = (data / "local-admin.key").read_text().strip()
        self.api = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=600)

    def turn(self, user: str, text: str) -> str:
        from openai import OpenAI

        with OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=600) as client:
            out = client.chat.completions.create(model="echo", user=user, messages=[{"role": "user", "content": text}])
        return out.choices[0].message.content or ""

    def deploy(self, agent_dir: Path) -> None:
        r = self.api.post("/v1/agents/echo/deployments", content=tar_dir(agent_dir),
                          headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    def sandbox(self, user: str) -> dict:
        r = self.api.get("/v1/sandboxes", params={"agent": "echo"})
        r.raise_for_status()
        (sb,) = [s for s in r.json()["data"] if s["scope"] == f"user:echo/{user}"]
        return sb

    def sleep(self, user: str) -> None:
        r = self.api.post(f"/v1/sandboxes/{self.sandbox(user)['id']}/sleep")
        assert r.status_code == 200 and r.json()["slept"] is True, r.text

    def stop(self, sig: int = signal.SIGTERM) -> str:
        self.api.close()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        return self.log.read_text(errors="replace")


def _records(data: Path) -> dict[str, tuple[str, dict]]:
    """Every instance's (state, meta) by scope, read from the store directly."""
    store = open_store(Config(data_dir=data))
    try:
        return {r.scope.key: (r.state, r.meta) for ts in store.operator.tenants() for r in ts.sandboxes.list()}
    finally:
        store.close()


def _qemu_pid(data: Path, sandbox_id: str) -> int | None:
    """The QEMU process the sandbox's metadata names, if it is alive and really that sandbox's."""
    pid = json.loads((data / "sandboxes" / sandbox_id / "meta.json").read_text()).get("pid")
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
    except OSError:
        return None
    return pid if b"qemu" in cmdline and sandbox_id.encode() in cmdline else None


def _pool(data: Path) -> list[str]:
    return [sid for p in (data / "pool").glob("*.json") for sid in json.loads(p.read_text())]


def _wait(cond, what: str, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "data"
    yield d
    # Whatever a failed assertion left running: stop its QEMUs (a passing test leaves none).
    from moorage.sandbox.microvm import MicroVMDriver

    if (d / "sandboxes").exists():
        drv = MicroVMDriver(d / "sandboxes", Config(data_dir=d))
        drv.kill_orphans()
        for sid in [p.name for p in (d / "sandboxes").iterdir() if (p / "meta.json").exists()]:
            pid = _qemu_pid(d, sid)
            if pid:
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_new_users_restore_the_fork_and_state_survives_pool_sleep_redeploy_and_restart(data: Path, tmp_path: Path) -> None:
    up = Up(data)
    try:
        up.deploy(_agent(tmp_path / "agents"))
        # The deploy asked for a pool of one: a pre-forked sleeping instance appears, owned by no user.
        _wait(lambda: len(_pool(data)) == 1, "the warm pool to fill")
        pooled = _pool(data)[0]
        # Prepared: its QEMU is already up with the template's state loaded, the guest paused.
        _wait(lambda: _qemu_pid(data, pooled) is not None, "the pool member's QEMU")
        assert up.turn("ada", "hello") == "1: hello"
        ada = up.sandbox("ada")
        # Provisioned from the template's snapshot (a fork restored), not a cold boot; from the pool.
        assert ada["wake_kind"] == "fork" and ada["id"] == pooled
        _wait(lambda: len(_pool(data)) == 1 and _pool(data)[0] != pooled, "the pool to refill")
        assert up.turn("bob", "hi") == "1: hi"
        assert up.sandbox("bob")["wake_kind"] == "fork"
        # Pool members are not users: only ada and bob have records.
        assert sorted(_records(data)) == ["user:echo/ada", "user:echo/bob"]

        assert up.turn("ada", "again") == "2: again"
        up.sleep("ada")
        assert up.turn("ada", "after sleep") == "3: after sleep"
        assert up.sandbox("ada")["wake_kind"] == "snapshot"

        # Redeploy: the old template's pool is emptied; users keep their instances and their files.
        old_pool = _pool(data)
        up.deploy(_agent(tmp_path / "agents", prefix="v2 "))
        _wait(lambda: len(_pool(data)) == 1 and set(_pool(data)).isdisjoint(old_pool), "the new template's pool")
        for sid in old_pool:
            assert not (data / "sandboxes" / sid).exists()
        assert up.turn("ada", "new code") == "v2 4: new code"
        assert up.turn("bob", "new code") == "v2 2: new code"
    finally:
        log = up.stop()
    # A clean stop put every awake instance to sleep (snapshot on disk) before the process exited.
    assert "awake instances put to sleep" in log, log[-2000:]
    recs = _records(data)
    assert {s for s, _ in recs.values()} == {"sleeping"}, recs
    for _, meta in recs.values():
        assert not meta.get("owner")
    ids = [p.name for p in (data / "sandboxes").iterdir() if (p / "meta.json").exists()]
    assert all(_qemu_pid(data, sid) is None for sid in ids)

    # Start again: the counter goes on from where it was.
    up = Up(data)
    try:
        assert up.turn("ada", "back") == "v2 5: back"
        assert up.sandbox("ada")["wake_kind"] == "snapshot"
    finally:
        up.stop()


@pytest.mark.slow
def test_detached_stop_leaves_vms_running_and_the_next_start_readopts_them(data: Path, tmp_path: Path) -> None:
    up = Up(data, "--detach")
    try:
        up.deploy(_agent(tmp_path / "agents", pool=0))
        assert up.turn("cy", "one") == "1: one"
        sid = up.sandbox("cy")["id"]
        # A detached exec running at the stop: no host follows it afterwards (its output would go nowhere), so the
        # stop ends it in the guest and says why, rather than record it failed while it runs on in the VM.
        r = up.api.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "echo started; exec sleep 301"],
                                                          "detach": True, "timeout_s": 600})
        assert r.status_code == 202, r.text
        exec_id = r.json()["id"]
        deadline = time.time() + 60
        while "started" not in up.api.get(f"/v1/executions/{exec_id}").json()["stdout"]:
            assert time.time() < deadline, "the detached exec did not start"
            time.sleep(0.2)
    finally:
        log = up.stop()
    assert "left running (detach)" in log, log[-2000:]
    pid = _qemu_pid(data, sid)
    assert pid is not None, "the VM should still run after a detached stop"
    assert _records(data)["user:echo/cy"][0] == "running"

    up = Up(data)
    try:
        # Re-adopted: the same QEMU process answers, with its memory and files.
        assert up.turn("cy", "two") == "2: two"
        assert _qemu_pid(data, sid) == pid
        ex = up.api.get(f"/v1/executions/{exec_id}").json()
        assert ex["status"] == "cancelled" and "live upgrade" in ex["error"], ex
        count = ("import os\nn = 0\nfor p in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
                 "        n += open(f'/proc/{p}/cmdline', 'rb').read() == b'sleep\\x00301\\x00'\n"
                 "    except OSError:\n        pass\nprint(n)")
        r = up.api.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", count]})
        assert r.status_code == 200 and r.json()["stdout"].strip() == "0", r.text
    finally:
        log = up.stop()
    assert _records(data)["user:echo/cy"][0] == "sleeping"
    assert _qemu_pid(data, sid) is None
