"""A live upgrade (``moorage up --detach``, then the new version's start) re-adopts micro-VMs whose guest code is the
older moorage's: it lives in the guest image their disks are overlays on. Their first turn or app request on the new
host restarts them onto its guest code (files kept, the same QEMU), so what the new ``ctx`` added works in them; and
an app whose server the agent's module starts answers with the new code right after a redeploy restarted it; a
sleep the previous release made restores with this version's device layout. bench/upgrade/run.py runs this across two real
versions; here the older guest is made from this one's, and the older sleep's record is test data."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.runtime.test_product_path import Up, _qemu_pid, data  # noqa: F401 - ``data``: the fixture

AGENT_PY = '''\
import http.server, threading

VERSION = "{version}"


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("page " + VERSION).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve():
    try:
        http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Page).serve_forever()
    except OSError:
        pass


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    if message == "spawn":
        return "spawned %d" % (await ctx.spawn(["sleep", "300"]))["pid"]
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return "%s %d" % (VERSION, n + 1)
'''

#: Run in the guest: its guest code made an older one's (``ctx.spawn`` taken out), and its supervisor ended a few
#: seconds later, once the host stopped, so the guest's init starts that code (as an older moorage's VM runs it).
MAKE_OLDER = r"""
import os, shutil, subprocess
path = "/opt/moorage/guest/agent_context.py"
src = open(path).read()
assert "    async def spawn(" in src
open(path, "w").write(src.replace("    async def spawn(", "    async def _spawn_not_yet("))
shutil.rmtree("/opt/moorage/guest/__pycache__", ignore_errors=True)
os.sync()
def cmdline(pid):
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:  # it ended since the listing
        return b""
mine = [p for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())
        and b"/opt/moorage/guest" in cmdline(p)]
subprocess.Popen(["sh", "-c", "sleep 8; kill -9 %s" % " ".join(mine)], start_new_session=True)
"""


def _agent(base: Path, version: str) -> Path:
    d = base / f"agent-{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\nports = [8080]\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\npool = 0\n')
    (d / "agent.py").write_text(AGENT_PY.format(version=version))
    return d


@pytest.mark.slow
def test_a_readopted_guest_on_older_guest_code_is_restarted_onto_the_new_one_files_kept(data: Path,  # noqa: F811
                                                                                         tmp_path: Path) -> None:
    up = Up(data, "--detach")
    try:
        up.deploy(_agent(tmp_path, "v1"))
        assert up.turn("ada", "hi") == "v1 1"
        sid = up.sandbox("ada")["id"]
        r = up.api.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", MAKE_OLDER]})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    finally:
        up.stop()
    pid = _qemu_pid(data, sid)
    assert pid is not None, "the VM should still run after a detached stop"
    time.sleep(12)  # the guest's supervisor ends, and its init starts the older code
    up = Up(data, "--detach")  # a host that takes that code for its own: the agent's code loaded into it as it is
    try:
        assert up.turn("ada", "hi") == "v1 2"
    finally:
        up.stop()
    # What an older moorage's VM has in its record: the guest code its image was built with (not this host's).
    meta_path = data / "sandboxes" / sid / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "guest_code": "0123456789abcdef"}))

    up = Up(data)
    try:
        # The app first: the request brings the guest onto this host's code before it is served, as a turn does
        # (before, the older guest code served it, and only the next turn restarted it).
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v1"), r.text
        r = up.api.post(f"/v1/sandboxes/{sid}/exec",
                        json={"argv": ["grep", "-c", "async def spawn(", "/opt/moorage/guest/agent_context.py"]})
        assert r.json()["stdout"].strip() == "1", r.text
        said = up.turn("ada", "spawn")
        assert said.startswith("spawned "), said
        assert up.turn("ada", "hi") == "v1 3"  # its files kept
        assert _qemu_pid(data, sid) == pid  # restarted in place: the same VM
        r = up.api.post(f"/v1/sandboxes/{sid}/exec",
                        json={"argv": ["grep", "-c", "async def spawn(", "/opt/moorage/guest/agent_context.py"]})
        assert r.json()["stdout"].strip() == "1", r.text
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v1"), r.text
    finally:
        log = up.stop()
    assert log.count("instance restarted onto this moorage's guest code") == 1, log[-3000:]
    assert "was=0123456789abcdef" in log, log[-3000:]


@pytest.mark.slow
def test_an_app_asked_right_after_a_redeploy_restarted_its_instance_answers_with_the_new_code(
        data: Path, tmp_path: Path) -> None:  # noqa: F811
    up = Up(data)
    try:
        up.deploy(_agent(tmp_path, "v1"))
        assert up.turn("ada", "hi") == "v1 1"
        assert up.api.get("/v1/agents/echo/users/ada/app/", timeout=60).text == "page v1"
        up.deploy(_agent(tmp_path, "v2"))
        # The turn loads v2, which restarts the instance (its app's server is v1's); its module starts v2's server,
        # which may still be binding its port when the app is asked (it was a 502 "not listening" then).
        assert up.turn("ada", "hi") == "v2 2"
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v2"), r.text
        up.deploy(_agent(tmp_path, "v3"))  # and when the app is asked first, before any turn loads v3
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v3"), r.text
    finally:
        up.stop()


#: The record e27f536 (the release before) kept of a micro-VM it put to sleep (``meta.json``: its VM's
#: configuration and its sleep's snapshot record), as test data.
OLD_SLEEP_META = Path(__file__).resolve().parents[1] / "data" / "upgrade" / "e27f536-sleeping-microvm-meta.json"


def test_a_sleep_the_previous_release_made_restores_with_this_versions_device_layout() -> None:
    from moorage.sandbox.microvm_qemu import VMConfig

    meta = json.loads(OLD_SLEEP_META.read_text())
    # The same device layout, so it wakes from its snapshot (``wake_kind`` snapshot), not cold from its disk: the
    # live run (bench/upgrade) wakes such a sleep; this holds the layout's id to it without QEMU or history.
    assert VMConfig(**meta["vm"]).layout_id() == meta["snapshot"]["layout"]
    assert {"kind", "qemu", "layout", "dev_sha256", "delta_xxh3"} <= set(meta["snapshot"])


#: An agent that runs the guest code's install (``microvm_guest_code._INSTALL``, written into it) on its own guest
#: package, the VM reset hard (sysrq ``b``: no flush, no unmount) at the install's worst point: right after the
#: exchange of the directories, before the flush that follows it.
CUT_AGENT = '''
import io, os, subprocess, tarfile

INSTALL = {install!r}
STOP_AT_SECOND_SYNC = r"""
import os
calls, flush = [0], os.sync
def sync():
    calls[0] += 1
    if calls[0] == 2:
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("b")
    flush()
os.sync = sync
"""


async def on_message(ctx, message):
    if message == "install and reset":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            t.add("/opt/moorage/guest", arcname=".", filter=lambda i: None if "__pycache__" in i.name else i)
        r = subprocess.run(["python3", "-c", STOP_AT_SECOND_SYNC + INSTALL, "/opt/moorage/guest"],
                           input=buf.getvalue(), capture_output=True)
        return "not reset: %d %s" % (r.returncode, r.stderr[-300:])
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return "turn %d" % (n + 1)
'''


@pytest.mark.slow
def test_a_vm_reset_hard_in_the_middle_of_the_guest_code_install_boots_with_working_guest_code(
        data: Path, tmp_path: Path) -> None:  # noqa: F811
    from moorage.sandbox.microvm_guest_code import _INSTALL

    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\npool = 0\n')
    (agent / "agent.py").write_text(CUT_AGENT.format(install=_INSTALL))
    up = Up(data)
    try:
        up.deploy(agent)
        assert up.turn("ada", "hi") == "turn 1"
        sid = up.sandbox("ada")["id"]
        pid = _qemu_pid(data, sid)
        try:
            said = up.turn("ada", "install and reset")
        except Exception:  # the VM went while the turn ran in it: what a crash looks like to its caller
            said = None
        assert said is None, said
        assert _qemu_pid(data, sid) is None or _qemu_pid(data, sid) != pid  # QEMU ended with the reset
        # Put to sleep as its disk (its QEMU gone), the next wake boots it from there: its guest code, the old
        # package or the new one, whole, serves the turn. The host may have slept it already, having seen its QEMU
        # end ("its guest stopped"): then the request finds nothing awake to sleep.
        r = up.api.post(f"/v1/sandboxes/{sid}/sleep")
        assert r.status_code == 200, r.text
        assert up.sandbox("ada")["state"] == "sleeping", up.sandbox("ada")
        assert up.turn("ada", "hi") == "turn 2"
        r = up.api.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["ls", "/opt/moorage/guest"]})
        assert r.status_code == 200 and "agent_context.py" in r.json()["stdout"].split(), r.text
    finally:
        up.stop()
