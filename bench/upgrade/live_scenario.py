"""A live upgrade on one micro-VM host: ``moorage up --detach`` on the old version, then the new version's start
re-adopts the running guests (whose guest code is the old version's: it lives in the guest image their disks are
overlays on)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from checks import Checks, Refused
from moorage.cli.up import tar_dir
from moorage.devservices.postgres import free_port

ROOT = Path(__file__).resolve().parents[2]
#: A counter, an app on port 8080 started when the module loads (its page names the deployment's VERSION), and
#: messages that use what the new guest code added (``ctx.spawn``, ``ctx.memory.facts(as_of=)``) or had before.
AGENT_PY = '''\
import http.server, threading, time

VERSION = "{version}"


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("page " + VERSION).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve():
    try:
        http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Page).serve_forever()
    except OSError:
        pass  # the port is held (an older module's server)


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    if message == "spawn":
        return str(await ctx.spawn(["sleep", "300"]))
    if message == "facts":
        return str(await ctx.memory.facts(as_of=time.time()))
    if message == "exec":
        return (await ctx.exec(["uname", "-r"]))["stdout"].strip()
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return VERSION + " " + str(n + 1)
'''


def write_agent(base: Path, version: str) -> Path:
    d = base / f"agent-{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\nports = [8080]\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\npool = 0\n')
    (d / "agent.py").write_text(AGENT_PY.format(version=version))
    return d


class Up:
    """One ``moorage up`` on the micro-VM driver (``src``: the version's source tree; None: this checkout)."""

    def __init__(self, data: Path, src: Path | None, *args: str) -> None:
        self.data, self.port = data, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        images = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
        images.mkdir(parents=True, exist_ok=True)
        data.mkdir(parents=True, exist_ok=True)
        if not (data / "images").exists():
            (data / "images").symlink_to(images)
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port),
               "MOORAGE_SANDBOX_DRIVER": "microvm", "MOORAGE_LOG_LEVEL": "info"}
        if src is not None:
            env["PYTHONPATH"] = str(src)
        self.log = data.parent / f"up-{'old' if src else 'new'}-{self.port}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up", *args], env=env, cwd=ROOT,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900  # a new guest image is built at the first start of a version
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"moorage up did not come up: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.3)
        self.api = httpx.Client(base_url=self.url, timeout=120,
                                headers={"Authorization": f"Bearer {(data / 'local-admin.key').read_text().strip()}"})

    def turn(self, user: str, text: str) -> str:
        r = self.api.post("/v1/agents/echo/invoke", json={"message": text, "user": user})
        return _ok(r)["reply"]

    def sandbox(self, user: str) -> dict[str, Any]:
        return next(s for s in _ok(self.api.get("/v1/sandboxes"))["data"] if s["scope"].endswith(f"/{user}"))

    def deploy(self, d: Path) -> None:
        _ok(self.api.post("/v1/agents/echo/deployments", content=tar_dir(d),
                          headers={"Content-Type": "application/gzip"}), 201)

    def stop(self) -> str:
        self.api.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.log.read_text(errors="replace")


def _ok(r: httpx.Response, *codes: int) -> Any:
    if r.status_code not in (codes or (200,)):
        if 400 <= r.status_code < 500:
            raise Refused(f"{r.status_code} {r.text[:300]}")
        raise AssertionError(f"{r.status_code} {r.text[:400]}")
    return r.json() if r.content else None


def _qemu_pids(data: Path) -> set[int]:
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd.split(b"\0")[0] and str(data).encode() in cmd:
                out.add(int(p.name))
    return out


def run(c: Checks, base: Path, *, old_src: Path) -> None:
    data = base / "data"
    up = Up(data, old_src, "--detach")
    try:
        up.deploy(write_agent(base, "v1"))
        c.check("old host: turns for three users (awake, awake, put to sleep)",
                lambda: [up.turn(u, "hi") for u in ("ada", "bob", "cy")])
        c.check("old host: cy put to sleep (its snapshot made by the old version)",
                lambda: _ok(up.api.post(f"/v1/sandboxes/{up.sandbox('cy')['id']}/sleep"))["slept"])
    finally:
        up.stop()
    vms = _qemu_pids(data)
    c.check("old host stopped with --detach: the awake micro-VMs run on",
            lambda: _assert(len(vms) == 2, f"{len(vms)} QEMU processes") or f"{len(vms)} QEMU processes")

    up = Up(data, None)
    try:
        sid = up.sandbox("bob")["id"]
        # Before any turn: exec, files and the app port are served by the old guest code itself.
        c.check("exec in a re-adopted old guest", lambda: _ok(up.api.post(f"/v1/sandboxes/{sid}/exec",
                                                                          json={"argv": ["cat", "counter.txt"]}))["stdout"])
        c.check("detached exec in a re-adopted old guest", lambda: _detached(up, sid))
        c.check("files listed and read in a re-adopted old guest", lambda: _files(up, sid))
        c.check("app port of a re-adopted old guest", lambda: _app(up, "bob", "page v1"))
        c.check("new host's first turn in a re-adopted old guest (same QEMU process, files kept)",
                lambda: _same(up.turn("ada", "hi"), "v1 2", _qemu_pids(data) >= vms))
        c.check("ctx.exec in a turn on a re-adopted guest", lambda: up.turn("bob", "exec"))
        c.check("ctx.spawn (new in the guest code) in a turn on a re-adopted guest", lambda: up.turn("bob", "spawn"))
        c.check("ctx.memory.facts(as_of=) (new in the guest code) on a re-adopted guest", lambda: up.turn("bob", "facts"))
        c.check("the new host's log says it restarted the old guests onto its guest code",
                lambda: _assert(up.log.read_text().count("restarted onto this moorage's guest code") >= 2,
                                "no such line for ada and bob") or "one line per instance")
        c.check("a snapshot the old version made (cy asleep) wakes under the new one",
                lambda: (up.turn("cy", "hi"), up.sandbox("cy")["wake_kind"]))
        up.deploy(write_agent(base, "v2"))
        c.check("redeploy of an app: an old guest's app restarts onto the new code",
                lambda: (up.turn("ada", "hi"), _app(up, "ada", "page v2")))
        c.check("redeploy of an app: the app of an old guest asked before any turn", lambda: _app(up, "bob", "page v2"))
        c.check("files kept across it", lambda: up.turn("bob", "hi"))
        c.check("an old guest sleeps and wakes under the new host",
                lambda: (_ok(up.api.post(f"/v1/sandboxes/{sid}/sleep")), up.turn("bob", "hi"),
                         up.sandbox("bob")["wake_kind"]))
        c.check("a new user (the new guest code, new template)", lambda: (up.turn("dee", "hi"), up.turn("dee", "spawn")))
    finally:
        log = up.stop()
    bad = [ln for ln in log.splitlines() if "Traceback" in ln or '"level": "error"' in ln or " ERROR " in ln]
    if bad:
        c.broken("new host's log has no error or traceback", f"{len(bad)} lines, first: {bad[0][:300]}")
    else:
        c.works("new host's log has no error or traceback")


def _assert(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _same(reply: str, want: str, same_vm: bool) -> str:
    _assert(reply == want and same_vm, f"{reply!r} (want {want!r}), same QEMU: {same_vm}")
    return reply


def _detached(up: Up, sid: str) -> str:
    ex = _ok(up.api.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "bg"], "detach": True}), 202)
    deadline = time.time() + 60
    while True:
        got = _ok(up.api.get(f"/v1/executions/{ex['id']}"))
        if got["status"] not in ("queued", "running"):
            _assert(got["status"] == "succeeded" and "bg" in got["stdout"], str(got)[:300])
            return got["status"]
        _assert(time.time() < deadline, "still running after 60 s")
        time.sleep(0.3)


def _files(up: Up, sid: str) -> str:
    names = [e["name"] for e in _ok(up.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "."}))["entries"]]
    got = _ok(up.api.get(f"/v1/sandboxes/{sid}/files/content", params={"path": "counter.txt"}))["content"]
    _assert("counter.txt" in names and got.isdigit(), f"{names} {got!r}")
    return f"{len(names)} entries, counter.txt {got!r}"


def _app(up: Up, user: str, want: str) -> str:
    r = up.api.get(f"/v1/agents/echo/users/{user}/app/", timeout=120)
    _assert(r.status_code == 200 and r.text == want, f"{r.status_code} {r.text[:300]!r} (want {want!r})")
    return r.text
