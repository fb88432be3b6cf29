"""`moorage up` SIGKILLed inside operations a user starts through the HTTP API, then started again on the same data
dir (tests/lifecycle/crash_up.py kills it at a chosen call): nothing stays in an in-between state, nothing
half-made is left, nothing that must happen once happens twice."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage.devservices.postgres import free_port
from tests.api.conftest import agent_archive
from tests.lifecycle.crash_up import Up, stop_sandboxes

GZ = {"content-type": "application/gzip"}


@pytest.fixture
def up(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Up]:
    driver = getattr(request, "param", "process")
    u = Up(tmp_path / "data", free_port(), driver)
    yield u
    u.stop()
    if driver == "process":
        stop_sandboxes(u.data)
    for pid in _guests_of(u.data / "sandboxes"):  # a micro-VM outlives its host by design
        os.kill(pid, signal.SIGKILL)


def _guests_of(path: Path) -> list[int]:
    """The processes (QEMU, bubblewrap) whose command line names a path under ``path``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]).startswith((b"qemu-system", b"bwrap")) and \
                any(str(path).encode() in a for a in argv):
            pids.append(int(pid))
    return pids


def _in_background(fn: Any) -> list[Any]:
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the host is killed under it
            out.append(e)

    threading.Thread(target=go, daemon=True).start()
    return out


@pytest.mark.parametrize("up, crash_at, after", [
    ("process", "moorage.runtime.templates:push_and_load", False),  # the builder sandbox is up, the code not loaded
    ("process", "moorage.sandbox.process:ProcessDriver.make_template", True),  # the template made, the deploy not ready
], indirect=["up"])
def test_killed_while_a_deploy_builds_the_deploy_ends_failed_and_the_live_one_serves(
        up: Up, tmp_path: Path, crash_at: str, after: bool) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"
    up.stop()
    up.start(crash_at, after=after)
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"),
                                      headers=GZ))
        assert up.died()
    up.start()
    with up.client() as c:
        deps = c.get("/v1/agents/echo/deployments").json()["data"]
        assert [d["status"] for d in deps] == ["ready", "failed"]
        assert c.get("/v1/agents/echo").json()["live_deployment"] == deps[0]["id"]
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"
        # Nothing of the cut-short build is left running or on disk: its builder sandbox is gone.
        sandboxes = sorted(p.name for p in (up.data / "sandboxes").iterdir())
        builders = [s for s in sandboxes if s.startswith("tpl-")]
        assert not builders, sandboxes
        assert _guests_of(up.data / "sandboxes" / "tpl-") == []
        r = c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"), headers=GZ)
        assert r.status_code == 201, r.text
        deps = c.get("/v1/agents/echo/deployments").json()["data"]
        assert [d["status"] for d in deps] == ["ready", "failed", "ready"]
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo2: hi"


def _zero(version: str) -> bytes:
    zero = '[agent.retention]\nzero_retention = true\n' if version == "2" else ""
    return _archive("z", f"async def on_message(ctx, m):\n    return 'z{version}: ' + m\n",
                    '[agent.lifecycle]\nusers = "auto"\n' + zero)


@pytest.mark.parametrize("crash_at, after, first", [
    ("moorage.store.repos.deployments:Deployments.set_status", True, True),  # ready, not yet live
    ("moorage.store.repos.deployments:Deployments.set_status", True, False),
    ("moorage.store.zero_retention:set_zero", False, False),  # live, its zero retention not yet set
])
def test_killed_as_a_deploy_goes_live_it_is_live_with_its_settings_or_failed(
        up: Up, crash_at: str, after: bool, first: bool) -> None:
    """Ready, live and the package's [agent.retention] were three steps: a host killed between them left the deploy
    listed ``ready`` but never live (a first deploy answered every turn 404 'no live deployment' until the operator
    deployed again), or live without its zero retention. Now it is all of them or none (the deploy failed)."""
    if not first:
        up.start()
        with up.client() as c:
            assert c.post("/v1/agents/z/deployments", content=_zero("1"), headers=GZ).status_code == 201
        up.stop()
    up.start(crash_at, after=after)
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/z/deployments", content=_zero("2"), headers=GZ))
        assert up.died()
    up.start()
    with up.client() as c:
        deps = c.get("/v1/agents/z/deployments").json()["data"]
        live = c.get("/v1/agents/z").json()["live_deployment"]
        zero = c.get("/v1/agents/z/retention").json()["zero_retention"]
        r = c.post("/v1/agents/z/invoke", json={"message": "hi", "user": "ada"})
        if deps[-1]["status"] == "ready":
            assert (live, zero, r.status_code, r.json().get("reply")) == (deps[-1]["id"], True, 200, "z2: hi"), deps
        else:
            assert deps[-1]["status"] == "failed", deps
            assert (live, zero) == (None if first else deps[0]["id"], False), deps
            assert (r.status_code, r.json().get("reply")) == ((404, None) if first else (200, "z1: hi")), r.text
        assert c.post("/v1/agents/z/deployments", content=_zero("2"), headers=GZ).status_code == 201
        assert c.get("/v1/agents/z/retention").json()["zero_retention"] is True
        assert c.post("/v1/agents/z/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "z2: hi"


@pytest.mark.parametrize("up", ["microvm"], indirect=True)
def test_killed_while_a_deploy_builds_its_micro_vm_does_not_run_on(up: Up, tmp_path: Path) -> None:
    """A micro-VM outlives its host by design: the build's ran on for ever, holding its memory and CPU."""
    up.start("moorage.runtime.templates:push_and_load")
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ))
        assert up.died()
    assert _guests_of(up.data / "sandboxes" / "tpl-")  # the builder VM lives on past its host
    up.start()
    with up.client() as c:
        assert [d["status"] for d in c.get("/v1/agents/echo/deployments").json()["data"]] == ["failed"]
        assert _guests_of(up.data / "sandboxes" / "tpl-") == []
        assert not [p for p in (up.data / "sandboxes").iterdir() if p.name.startswith("tpl-")]
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"


def _dirs_and_rows(up: Up, c: httpx.Client) -> tuple[set[str], set[str]]:
    """The instances' sandbox directories on disk, and the instances the store lists."""
    dirs = {p.name for p in (up.data / "sandboxes").iterdir() if not p.name.startswith((".", "tpl-"))}
    return dirs, {s["id"] for s in c.get("/v1/sandboxes", params={"limit": 100}).json()["data"]}


@pytest.mark.parametrize("crash_at, after", [
    ("moorage.sandbox.process:ProcessDriver.fork", False),  # the instance's row claimed, no sandbox yet
    ("moorage.sandbox.process:ProcessDriver.fork", True),  # its sandbox forked, not started
    ("moorage.lifecycle.sleeping:Sleeping.sleep", False),  # provisioned and running, not put to sleep yet
])
def test_killed_while_provisioning_a_user_it_can_be_provisioned_again(
        up: Up, tmp_path: Path, crash_at: str, after: bool) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
    up.stop()
    up.start(crash_at, after=after)
    with up.client() as c:
        _in_background(lambda: c.put("/v1/agents/echo/users/ada", params={"provision": "true"}, json={}))
        assert up.died()
    up.start()
    with up.client() as c:
        r = c.put("/v1/agents/echo/users/ada", params={"provision": "true"}, json={})
        assert r.status_code in (200, 201), r.text
        assert r.json()["instance"]["state"] == "sleeping", r.json()
        dirs, rows = _dirs_and_rows(up, c)
        assert dirs == rows == {r.json()["instance"]["sandbox_id"]}, (dirs, rows)
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"


TT_AGENT = '''
async def on_message(ctx, message):
    ctx.files.write(f"notes/{message}.txt", message)
    await ctx.memory.learn("user", "said", message, f"said {message}")
    return "noted " + message
'''


def _tt_archive() -> bytes:
    return _archive("tt", TT_AGENT, '[agent.timetravel]\nauto = true\n[agent.lifecycle]\nusers = "auto"\n')


def _archive(name: str, body: str, tables: str) -> bytes:
    import io
    import tarfile

    files = {"moorage.toml": f'[agent]\nname = "{name}"\nentry = "agent.py"\n{tables}', "agent.py": body}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def _walk(data: Path) -> list[Path]:
    """Every file and directory under ``data``; one removed while it is walked (a checkpoint's copy being made or
    dropped by the host, which keeps serving) is passed over, where ``rglob`` raised FileNotFoundError."""
    out: list[Path] = []
    for root, dirs, files in os.walk(data):  # errors (a directory gone before it was listed) are ignored
        out += [Path(root) / n for n in (*dirs, *files)]
    return out


def _rows_about(data: Path, user: str) -> dict[str, int]:
    """Rows of any SQLite database under ``data`` that name ``user`` in a user column or a scope key."""
    import sqlite3

    found: dict[str, int] = {}
    for db in _walk(data):
        try:  # a file being made (a checkpoint's lock, a temporary) may be gone by the time it is looked at
            if not db.is_file() or db.suffix in (".log", ".key", ".json", ".txt") or db.stat().st_size < 100:
                continue
            with open(db, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    continue
        except FileNotFoundError:
            continue
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
                for col in [r[1] for r in conn.execute(f"PRAGMA table_info('{table}')")]:
                    if table == "spans" and col == "user_id":  # the erasure request's own span is its record
                        n = conn.execute("SELECT COUNT(*) FROM spans WHERE user_id = ? AND name != ?",
                                         (user, "DELETE /v1/agents/{agent}/users/{user}")).fetchone()[0]
                    elif col in ("user", "user_id", "end_user") or col == "id" and table == "end_users":
                        n = conn.execute(f'SELECT COUNT(*) FROM "{table}" WHERE "{col}" = ?', (user,)).fetchone()[0]
                    elif col == "scope_key":
                        n = conn.execute(f'SELECT COUNT(*) FROM "{table}" WHERE "{col}" LIKE ?',
                                         (f"%user:{user}%",)).fetchone()[0]
                    else:
                        continue
                    if n:
                        found[f"{db.name}:{table}.{col}"] = n
        finally:
            conn.close()
    return found


@pytest.mark.parametrize("crash_at, after", [
    ("moorage.sandbox.process_sandbox:ProcessSandbox.destroy", True),  # the sandbox gone, its row not
    ("moorage.runtime.templates:Templates.delete_forks", False),  # the row gone, checkpoints and memory not
    ("moorage.store.agent_users:AgentUsers.delete", False),  # everything gone but the user's registration
])
def test_killed_while_forgetting_a_user_the_forget_repeated_leaves_nothing(
        up: Up, tmp_path: Path, crash_at: str, after: bool) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        for who in ("ada", "bob"):
            for n in range(3):
                r = c.post("/v1/agents/tt/invoke", json={"message": f"m{n}", "user": who})
                assert r.json()["reply"] == f"noted m{n}", r.text
        assert c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]
        before = _rows_about(up.data, "ada")
        assert before, "the setup wrote nothing about ada"
    up.stop()
    up.start(crash_at, after=after)
    with up.client() as c:
        _in_background(lambda: c.delete("/v1/agents/tt/users/ada"))
        assert up.died()
    up.start()
    with up.client() as c:
        r = c.delete("/v1/agents/tt/users/ada")
        assert r.status_code in (200, 204, 404), r.text
        assert _rows_about(up.data, "ada") == {}
        assert c.get("/v1/agents/tt/users/ada").status_code == 404
        (bob,) = c.get("/v1/sandboxes", params={"limit": 100}).json()["data"]
        dirs, rows = _dirs_and_rows(up, c)
        assert dirs == rows == {bob["id"]}, (dirs, rows)
        # "ada" as a word of a name, not inside a random hex id (bob's sandbox 5ada4e0f... matched once).
        named = [p for p in _walk(up.data) if re.search(r"(?<![0-9a-f])ada(?![0-9a-f])", p.name)]
        assert not named, named
        # The other user is whole, and ada can start again from nothing.
        assert c.post("/v1/agents/tt/invoke", json={"message": "m3", "user": "bob"}).json()["reply"] == "noted m3"
        assert len(c.get("/v1/agents/tt/users/bob/checkpoints").json()["data"]) >= 3
        assert c.post("/v1/agents/tt/invoke", json={"message": "m9", "user": "ada"}).json()["reply"] == "noted m9"


def _wait(fn: Any, what: str, timeout: float = 30) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while True:
        out = fn()
        if out:
            return out
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_killed_while_a_detached_exec_runs_it_ends_interrupted_and_the_sandbox_serves(up: Up, tmp_path: Path) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).status_code == 200
        (box,) = c.get("/v1/sandboxes").json()["data"]
        r = c.post(f"/v1/sandboxes/{box['id']}/exec",
                   json={"argv": ["sh", "-c", "echo ready $$; exec sleep 600"], "detach": True, "timeout_s": 900})
        assert r.status_code == 202, r.text
        ex = r.json()["id"]
        view = _wait(lambda: (v := c.get(f"/v1/executions/{ex}").json()) and "ready" in v["stdout"] and v,
                     "the exec runs")
        pid = int(view["stdout"].split()[1])
    up.kill()
    up.start()
    with up.client() as c:
        view = c.get(f"/v1/executions/{ex}").json()
        assert view["status"] == "interrupted", view
        assert c.post(f"/v1/sandboxes/{box['id']}/exec", json={"argv": ["echo", "still here"]}).json()["stdout"] \
            == "still here\n"
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo: hi"
        # What the interrupted exec ran does not run on unseen in the sandbox.
        ps = c.post(f"/v1/sandboxes/{box['id']}/exec", json={"argv": [
            "sh", "-c", "for p in /proc/[0-9]*; do echo $(basename $p) $(tr '\\0' ' ' < $p/cmdline); done"]}).json()
        assert "/proc/[0-9]*" in ps["stdout"] and f"{pid} sleep 600" not in ps["stdout"], ps


APPROVAL_AGENT = '''
import asyncio

def charge():
    with open("/work/charges.log", "a") as f:
        f.write("charged\\n")
    return "charged"

async def on_message(ctx, message):
    draft = await ctx.step("draft", lambda: "draft-1")
    answer = await ctx.interrupt({"question": "ship it?", "draft": draft})
    await ctx.step("charge", charge)
    await asyncio.sleep(2)
    return f"{draft} -> {answer}"
'''


@pytest.mark.parametrize("when", ["answer recorded", "after the charge"])
def test_killed_around_an_approval_the_answer_resumes_the_turn_once(up: Up, tmp_path: Path, when: str) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=APPROVAL_AGENT),
                      headers=GZ).status_code == 201
        r = c.post("/v1/agents/echo/invoke", json={"message": "buy", "user": "ada"}).json()
        assert r["status"] == "waiting", r
        run_id = r["run_id"]
        (box,) = c.get("/v1/sandboxes").json()["data"]

        def charges() -> str:
            r = c.get(f"/v1/sandboxes/{box['id']}/files/content", params={"path": "charges.log"})
            return r.json()["content"] if r.status_code == 200 else ""

        if when == "after the charge":
            _in_background(lambda: c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"}))
            _wait(charges, "the step after the approval ran")
    if when == "answer recorded":
        up.stop()
        up.start("moorage.durable.engine:DurableEngine.answer", after=True)
        with up.client() as c:
            _in_background(lambda: c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"}))
            assert up.died()
    else:
        up.kill()
    up.start()
    with up.client() as c:
        if when == "waiting":
            r = c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "yes"})
            assert r.status_code == 200 and r.json()["reply"] == "draft-1 -> yes", r.text
        run = _wait(lambda: (w := c.get(f"/v1/workflows/{run_id}").json()["run"])["status"] != "running" and w,
                    "the run ends")
        assert run["status"] == "succeeded" and run["result"]["reply"] == "draft-1 -> yes", run
        again = c.post(f"/v1/workflows/{run_id}/answer", json={"answer": "no"})
        assert again.status_code == 409, again.text
        assert charges() == "charged\n"


class _Receiver:
    """A webhook endpoint on 127.0.0.1: its first request is read and never answered (the host dies meanwhile)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if len(receiver.requests) == 1:
                    receiver.release.wait(60)
                    return
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_killed_while_a_webhook_is_being_delivered_it_is_sent_again_with_the_same_id(tmp_path: Path) -> None:
    import time

    from moorage.client import verify_webhook

    up = Up(tmp_path / "data", free_port(), MOORAGE_EGRESS_ALLOW_CIDRS="127.0.0.0/8")
    receiver = _Receiver()
    try:
        up.start()
        with up.client() as c:
            assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
            hook = c.post("/v1/agents/echo/webhooks", json={"url": receiver.url,
                                                             "events": ["execution.succeeded"]}).json()
            ex = c.post("/v1/agents/echo/invoke", params={"async": "true"},
                        json={"message": "hi", "user": "ada"}).json()
            _wait(lambda: receiver.requests, "the delivery reaches the receiver")
        up.kill()  # while the receiver holds the request: the host never learns how it went
        up.start()
        with up.client() as c:
            # At once: the claim was the killed process's own; waiting out its 15 s lease delayed every such event.
            _wait(lambda: len(receiver.requests) >= 2, "the delivery is sent again within 3 s of the restart", 3)
            (d,) = c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries").json()["data"]
            _wait(lambda: c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries/{d['id']}").json()["status"]
                  == "delivered", "the delivery is recorded delivered")
            time.sleep(1.5)  # more rounds of the delivery loop: nothing is sent after it was delivered
        assert len(receiver.requests) == 2
        events = [verify_webhook(hook["secret"], body, headers) for headers, body in receiver.requests]
        assert events[0] == events[1] and events[0]["data"]["execution_id"] == ex["id"]
        # One id for both: the receiver tells the second for the same event.
        assert receiver.requests[0][0]["webhook-id"] == receiver.requests[1][0]["webhook-id"] == d["id"]
    finally:
        receiver.close()
        up.stop()
        stop_sandboxes(up.data)


def _pooled(reply: str = "p") -> bytes:
    return _archive("p", f"async def on_message(ctx, m):\n    return '{reply}: ' + m\n",
                    '[agent.lifecycle]\nusers = "auto"\npool = 1\n')


def _members(up: Up) -> set[str]:
    import json

    return {sid for m in (up.data / "pool").glob("*.json") for sid in json.loads(m.read_text())}


def test_killed_while_the_warm_pool_forks_the_fork_is_not_left_behind(up: Up, tmp_path: Path) -> None:
    """A pool member belongs to no tenant's record until a user takes it: one forked but not yet in the pool's
    manifest when the host died stayed on disk for ever."""
    up.start("moorage.lifecycle.pool:WarmPool._write")  # the first fork made, the manifest not written
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/p/deployments", content=_pooled(), headers=GZ))
        assert up.died()

    def members() -> set[str]:
        return _members(up)

    (half,) = {p.name for p in (up.data / "sandboxes").iterdir() if not p.name.startswith(".")}
    assert members() == set()
    up.start()
    with up.client() as c:
        _wait(lambda: len(members()) == 1 and half not in members(), "the pool refilled")
        dirs, rows = _dirs_and_rows(up, c)
        assert half not in dirs and dirs == rows | members(), (half, dirs, rows, members())
        assert c.post("/v1/agents/p/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "p: hi"
        _wait(lambda: (dr := _dirs_and_rows(up, c)) and len(dr[1]) == 1 and len(members()) == 1
              and dr[0] == dr[1] | members(), "the user took the pooled fork and the pool refilled")


def test_killed_while_a_redeploy_drains_the_warm_pool_its_members_are_not_left_behind(up: Up, tmp_path: Path) -> None:
    """A redeploy takes the old template's members out of the pool's manifest, then destroys them: a crash between
    left them on disk for ever."""
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/p/deployments", content=_pooled(), headers=GZ).status_code == 201
        (old,) = _wait(lambda: _members(up), "the pool filled")
    up.stop()
    up.start("moorage.lifecycle.pool:_destroy")  # the old members out of the manifest, none destroyed yet
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/p/deployments", content=_pooled("p2"), headers=GZ))
        assert up.died()
    assert (up.data / "sandboxes" / old).exists() and old not in _members(up)
    up.start()
    with up.client() as c:
        _wait(lambda: len(_members(up)) == 1 and not (up.data / "sandboxes" / old).exists(), "the old member went")
        dirs, rows = _dirs_and_rows(up, c)
        assert dirs == rows | _members(up) and not rows, (dirs, rows, _members(up))
        assert c.post("/v1/agents/p/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "p2: hi"


@pytest.mark.parametrize("after", [False, True])  # the member out of the manifest, no row yet / the row written
def test_killed_while_the_warm_pool_hands_a_member_to_a_user_it_is_not_left_behind(
        up: Up, tmp_path: Path, after: bool) -> None:
    """A new user takes a member out of the pool's manifest, then their instance row names it: a crash between left
    a fork nothing named, on disk for ever."""
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/p/deployments", content=_pooled(), headers=GZ).status_code == 201
        (member,) = _wait(lambda: _members(up), "the pool filled")
    up.stop()
    up.start("moorage.lifecycle.machine:provision", after=after)
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/p/invoke", json={"message": "hi", "user": "ada"}))
        assert up.died()
    assert (up.data / "sandboxes" / member).exists() and member not in _members(up)
    up.start()
    with up.client() as c:
        _wait(lambda: len(_members(up)) == 1 and member not in _members(up)
              and not (up.data / "sandboxes" / member).exists(), "the handed-over member went, the pool refilled")
        assert c.post("/v1/agents/p/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "p: hi"
        assert c.post("/v1/agents/p/invoke", json={"message": "hi", "user": "bob"}).json()["reply"] == "p: hi"
        _wait(lambda: (dr := _dirs_and_rows(up, c)) and len(dr[1]) == 2 and len(_members(up)) == 1
              and dr[0] == dr[1] | _members(up), "every fork on disk is a user's or the pool's")


def _half_made_checkpoints(data: Path) -> list[Path]:
    return [d for d in (data / "sandboxes").glob("*/checkpoints/.*") if ".deleting-" not in d.name]


def test_killed_while_a_checkpoint_is_copied_its_hidden_copy_is_removed_at_the_next_start(
        up: Up, tmp_path: Path) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        for n in range(2):
            assert c.post("/v1/agents/tt/invoke", json={"message": f"m{n}", "user": "ada"}).json()["reply"] == f"noted m{n}"
        kept = len(c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"])
    up.stop()
    # Killed with the layer copied under its hidden name, before it is renamed to the checkpoint's.
    up.start("moorage.sandbox.process_checkpoints:write_index")
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/tt/users/ada/checkpoints", json={"name": "before-upgrade"}))
        assert up.died()
    left = _half_made_checkpoints(up.data)
    assert left and all((d / "layer").is_dir() for d in left), left  # a copy of the layer, named by nothing
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/invoke", json={"message": "m2", "user": "ada"}).json()["reply"] == "noted m2"
        c.get("/v1/agents/tt/users/ada/checkpoints")  # once m2's own checkpoint, copied behind its reply, is made
        assert _half_made_checkpoints(up.data) == []
        r = c.post("/v1/agents/tt/users/ada/checkpoints", json={"name": "before-upgrade"})
        assert r.status_code == 201, r.text
        assert len(c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]) >= kept + 2  # m2's and this one
    # A checkpoint made whole carries no lock file of its making.
    assert not list((up.data / "sandboxes").glob("*/checkpoints/*/.making"))


@pytest.mark.parametrize("crash_at, nth", [
    ("moorage.runtime.operator_verbs:OperatorVerbs._forget", 2),  # one user forgotten, the others not
    ("moorage.store.forget_agent:_forget_agent", 1),  # every user forgotten, the agent's own rows not
])
def test_killed_in_an_agent_delete_it_stays_marked_and_sending_it_again_finishes_it(
        up: Up, tmp_path: Path, crash_at: str, nth: int) -> None:
    """What docs/api.md says of ``DELETE /v1/agents/{agent}`` cut short: the agent stays marked (no turn, user or
    deploy for it meanwhile), and the same delete sent again forgets what is left; the name is then free."""
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ).status_code == 201
        for user in ("ada", "bob"):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": user}).status_code == 200
        assert c.put("/v1/agents/echo/users/cat", json={}).status_code == 201
        instances = [s["id"] for s in c.get("/v1/sandboxes").json()["data"]]
    assert len(instances) == 2
    up.stop()
    up.start(crash_at, nth=nth)
    with up.client() as c:
        _in_background(lambda: c.delete("/v1/agents/echo"))
        assert up.died()
    up.start()
    with up.client() as c:
        assert c.get("/v1/agents/echo").json()["config"]["deleting"]["since"] > 0
        for r in (c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}),
                  c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="2"), headers=GZ)):
            assert r.status_code == 409 and "being deleted" in r.json()["detail"], r.text
        r = c.delete("/v1/agents/echo")
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert r.json()["users"] == (2 if nth == 2 else 0), r.text  # the users the first delete had not reached
        assert c.get("/v1/agents/echo").status_code == 404
        assert c.get("/v1/sandboxes").json()["data"] == []
        assert not any((up.data / "sandboxes" / s).exists() for s in instances)
        assert c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, version="3"), headers=GZ).status_code == 201
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "echo3: hi"
        assert [u["id"] for u in c.get("/v1/agents/echo/users").json()["data"]] == ["ada"]


@pytest.mark.parametrize("crash_at, nth", [
    ("moorage.runtime.agent_delete:AgentDeletion.delete_agent", 2),  # one agent deleted, the other not
    ("moorage.store.base:Backend.delete_tenant", 1),  # every agent deleted, the tenant's store and row not
])
def test_killed_in_a_tenant_delete_it_stays_marked_and_sending_it_again_finishes_it(
        up: Up, tmp_path: Path, crash_at: str, nth: int) -> None:
    """What docs/api.md says of ``DELETE /v1/tenants/{tenant}`` cut short: the tenant stays marked, its keys revoked
    (nothing gets in meanwhile), and the same delete sent again finishes it; the next start makes a new local
    tenant, empty."""
    up.start()
    with up.client() as c:
        for agent in ("echo", "helper"):
            r = c.post(f"/v1/agents/{agent}/deployments", content=agent_archive(tmp_path, agent), headers=GZ)
            assert r.status_code == 201, r.text
            assert c.post(f"/v1/agents/{agent}/invoke", json={"message": "hi", "user": "ada"}).status_code == 200
        instances = [s["id"] for s in c.get("/v1/sandboxes").json()["data"]]
    assert len(instances) == 2
    up.stop()
    up.start(crash_at, nth=nth)
    op = httpx.Client(base_url=up.url, timeout=60,
                      headers={"Authorization": f"Bearer {(up.data / 'api' / 'operator-token').read_text().strip()}"})
    _in_background(lambda: op.delete("/v1/tenants/local"))
    assert up.died()
    up.start()
    op = httpx.Client(base_url=up.url, timeout=60, headers=op.headers)
    with up.client() as c:
        assert c.get("/v1/agents").status_code == 401  # its keys were revoked before anything else
    assert op.get("/v1/tenants/local/limits").status_code == 200  # still there, marked
    r = op.delete("/v1/tenants/local")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert r.json()["agents"] == (1 if nth == 2 else 0), r.text  # the agents the first delete had not reached
    assert op.get("/v1/tenants/local/limits").status_code == 404
    assert not any((up.data / "sandboxes" / s).exists() for s in instances)
    up.stop()
    up.start()
    with up.client() as c:
        assert c.get("/v1/agents").json()["data"] == []
