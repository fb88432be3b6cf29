"""A rolling upgrade's middle: host h1 on the old version, h2 on the new, one PostgreSQL store and one S3 bucket."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from checks import Checks, Refused
from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost, fleet_env, write_counter_agent
from moorage.devservices.postgres import start_cluster
from moorage.devservices.seaweedfs import start_seaweedfs
from moorage.store import open_store

OLD, NEW = 0, 1


class Receiver:
    """A webhook receiver on this machine: the deliveries it got (their bodies)."""

    def __init__(self) -> None:
        got = self.got = []

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"


def _ok(r: httpx.Response, *codes: int) -> Any:
    if r.status_code not in (codes or (200,)):
        if r.status_code < 500 and r.headers.get("content-type", "").startswith("application/problem+json"):
            raise Refused(f"{r.status_code} {r.json().get('detail', r.text)[:300]}")
        raise AssertionError(f"{r.status_code} {r.text[:400]}")
    return r.json() if r.content else None


class MixedFleet:
    def __init__(self, base: Path, old_src: Path) -> None:
        self.base = base
        self.pg = start_cluster()
        self.store_url = self.pg.create_database("upgrade")
        self.s3 = start_seaweedfs()
        self.s3.create_bucket("upgrade")
        self.env = fleet_env(self.store_url, self.s3.settings("upgrade", "fleet"), lease_ttl_s="4", heartbeat_s="1",
                             egress_allow_cidrs="127.0.0.0/8")
        self.old_src = old_src
        self.hosts: list[LocalHost] = []
        self.api: list[httpx.Client] = []

    def start(self, name: str, old: bool) -> LocalHost:
        env = {**self.env, **({"PYTHONPATH": str(self.old_src)} if old else {})}
        h = LocalHost(name, self.base / name, env, start_timeout_s=180)
        self.hosts.append(h)
        self.api.append(h.client(self.hosts[0].key))
        return h

    def deploy(self, via: int, text: str = "") -> str:
        d = write_counter_agent(self.base / f"agent-{via}-{time.monotonic_ns()}")
        if text:
            (d / "agent.py").write_text((d / "agent.py").read_text().replace('f"{n + 1}: {message}"',
                                                                             f'f"{text}{{n + 1}}: {{message}}"'))
        r = self.api[via].post("/v1/agents/echo/deployments", content=tar_dir(d),
                               headers={"Content-Type": "application/gzip"})
        return _ok(r, 201)["id"]

    def turn(self, via: int, user: str, text: str = "hi") -> httpx.Response:
        return self.api[via].post("/v1/agents/echo/invoke", json={"message": text, "user": user})

    def reply(self, via: int, user: str, text: str = "hi") -> tuple[str, str]:
        r = self.turn(via, user, text)
        return _ok(r)["reply"], r.headers.get("x-moorage-served-by", "")

    def record(self, user: str) -> Any:
        store = open_store(Config(store_url=self.store_url))
        try:
            return {r.scope.user: r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=10000)}[user]
        finally:
            store.close()

    def sleep(self, via: int, user: str) -> None:
        r = self.api[via].post(f"/v1/sandboxes/{self.record(user).id}/sleep")
        assert _ok(r)["slept"] is True, r.text

    def close(self) -> None:
        for c in self.api:
            c.close()
        for h in self.hosts:
            h.stop()
        self.s3.stop()
        self.pg.stop()


def _until(cond: Any, what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.3)


def run(c: Checks, base: Path, *, old_src: Path) -> None:
    f = MixedFleet(base, old_src)
    try:
        _run(c, f)
    finally:
        f.close()
        for h in f.hosts:
            errors = [ln for ln in h.log.read_text(errors="replace").splitlines() if "Traceback" in ln
                      or '"level": "error"' in ln or " ERROR " in ln]
            if errors:
                c.broken(f"{h.name}'s log has no error or traceback", f"{len(errors)} lines, first: {errors[0][:300]}")
            else:
                c.works(f"{h.name}'s log has no error or traceback")


def _run(c: Checks, f: MixedFleet) -> None:
    f.start("h1", old=True)
    c.check("old host h1 starts on an empty store and serves a deploy and a turn",
            lambda: (f.deploy(OLD), f.reply(OLD, "ada"))[1])
    started = time.monotonic()
    holder: dict[str, Any] = {}

    def serve_meanwhile() -> None:  # the old host keeps serving while the new one migrates the store
        n = 0
        while not holder.get("up"):
            try:
                f.reply(OLD, "ada")
                n += 1
            except Exception as e:  # noqa: BLE001
                holder.setdefault("errors", []).append(str(e)[:200])
            time.sleep(0.2)
        holder["turns"] = n

    t = threading.Thread(target=serve_meanwhile)
    t.start()
    try:
        f.start("h2", old=False)
    finally:
        holder["up"] = True
        t.join()
    c.check("new host h2 starts (migrates the store) while h1 serves turns",
            lambda: (_ for _ in ()).throw(AssertionError(holder["errors"])) if holder.get("errors")
            else f"h2 up in {time.monotonic() - started:.1f} s, h1 served {holder['turns']} turns meanwhile")
    c.check("old host serves on the migrated store: a turn and a new user",
            lambda: (f.reply(OLD, "ada"), f.reply(OLD, "cy"))[1])
    c.check("new host's request for a user on the old host is forwarded there",
            lambda: _served(f.reply(NEW, "ada"), "h1"))
    c.check("new host serves a new user of its own", lambda: f.reply(NEW, "bob"))
    c.check("old host's request for a user on the new host is forwarded there",
            lambda: _served(f.reply(OLD, "bob"), "h2"))
    c.check("new host's read of a sandbox on the old host (files, forwarded)",
            lambda: _ok(f.api[NEW].get(f"/v1/sandboxes/{f.record('ada').id}/files/content",
                                       params={"path": "counter.txt"})))
    c.check("old host's read of a sandbox on the new host (files, forwarded)",
            lambda: _ok(f.api[OLD].get(f"/v1/sandboxes/{f.record('bob').id}/files/content",
                                       params={"path": "counter.txt"})))
    c.check("streamed turn forwarded new → old", lambda: _stream(f, NEW, "ada"))
    c.check("streamed turn forwarded old → new", lambda: _stream(f, OLD, "bob"))

    recv = Receiver()
    hook = c.check("webhook subscribed through the new host",
                   lambda: _ok(f.api[NEW].post("/v1/agents/echo/webhooks",
                                               json={"url": recv.url, "events": ["execution.succeeded"]}), 201)["id"])
    for via, user, name in ((OLD, "ada", "old"), (NEW, "bob", "new"), (OLD, "bob", "old"), (NEW, "ada", "new")):
        c.check(f"async turn sent to the {name} host for a user on {f.record(user).host} ends succeeded",
                lambda via=via, user=user: _async(f, via, user))
    if hook:
        c.check("webhook deliveries of those async turns all arrive (claimed by either host)",
                lambda: _until(lambda: len(recv.got) >= 4 and f"{len(recv.got)} deliveries", "4 deliveries", 60))

    c.check("instance moved old → new: slept on h1, woken through h2 from h1's shipment",
            lambda: _moved(f, "ada", OLD, NEW, "h2"))
    c.check("instance moved new → old: slept on h2, woken through h1 from h2's shipment",
            lambda: _moved(f, "bob", NEW, OLD, "h1"))

    c.check("deploy through the new host; the old host's new user runs it (template published by h2)",
            lambda: _deployed(f, NEW, OLD, "dee", "v-new "))
    c.check("deploy through the old host; the new host's new user runs it (template published by h1)",
            lambda: _deployed(f, OLD, NEW, "eve", "v-old "))
    c.check("existing users on both hosts run the live deployment after it",
            lambda: [f.reply(OLD, "ada")[0], f.reply(NEW, "bob")[0]])
    c.check("GET /v1/sandboxes lists every instance through either host",
            lambda: [len(_ok(f.api[i].get("/v1/sandboxes"))["data"]) for i in (OLD, NEW)])
    for i, name in ((NEW, "new"), (OLD, "old")):
        c.check(f"GET /v1/workflows?agent=echo&user=ada (a filter new in this version) through the {name} host "
                "lists ada's runs only", lambda i=i: _runs_of(f, i, "ada"))

    # The rolling upgrade goes on: h1 drained (its users move to h2), stopped, and started again on the new version.
    c.check("h1 (old) drained: its instances sleep, ship and are served by h2", lambda: _drain(f, "h1"))
    c.check("h1 restarted on the OLD version after the new one migrated the store", lambda: _restart_old(f))
    c.check("h1 upgraded: started on the new version, its users served through both hosts",
            lambda: _upgraded(f))


def _runs_of(f: MixedFleet, via: int, user: str) -> str:
    runs = _ok(f.api[via].get("/v1/workflows", params={"agent": "echo", "user": user, "limit": 200}))["data"]
    others = sorted({r["scope"].split(":", 1)[1].split("/")[1] for r in runs} - {user})
    assert not others, (f"{len(runs)} runs, of users {others} too: this version ignores user= (docs/operations.md, "
                        "rolling upgrade: until every host is upgraded, a request answers as the version that gets it)")
    return f"{len(runs)} runs, all {user}'s"


def _drain(f: MixedFleet, host: str) -> str:
    import subprocess
    import sys

    env = {**__import__("os").environ, "MOORAGE_STORE_URL": f.store_url}
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "hosts", "drain", host], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    h = f.hosts[OLD]
    h.proc.wait(timeout=120)  # a drained host stops by itself once it shipped what it held
    replies = [f.reply(NEW, u)[0] for u in ("ada", "cy", "dee")]
    hosts = {u: f.record(u).host for u in ("ada", "cy", "dee")}
    assert set(hosts.values()) == {"h2"}, hosts
    return f"h1 exited {h.proc.returncode}; {replies} all on h2"


def _restart_old(f: MixedFleet) -> str:
    env = {**f.env, "PYTHONPATH": str(f.old_src)}
    try:
        h = LocalHost("h1", f.base / "h1", env, start_timeout_s=60)
    except RuntimeError as e:
        said = str(e)
        if "newer than this moorage knows" in said:
            raise Refused(said[said.index("the store's schema"):][:300]) from None
        raise
    h.stop()
    return "it started"


def _upgraded(f: MixedFleet) -> str:
    h = LocalHost("h1", f.base / "h1", f.env, start_timeout_s=120)
    f.hosts[OLD] = h
    f.api[OLD] = h.client(f.hosts[NEW].key)
    out = [f.reply(OLD, u) for u in ("ada", "bob", "fay")] + [f.reply(NEW, "fay")]
    return str(out)


def _served(got: tuple[str, str], owner: str) -> str:
    reply, by = got
    assert by == owner, f"served by {by!r}, not {owner}"
    return f"{reply!r}, served by {by}"


def _stream(f: MixedFleet, via: int, user: str) -> str:
    with f.api[via].stream("POST", "/v1/agents/echo/invoke", params={"stream": "true"}, json={"message": "s", "user": user}) as r:
        body = r.read().decode()
    assert r.status_code == 200, body[:300]
    assert "event: error" not in body and "event:" in body, body[-300:]
    return f"{body.count('event:')} events"


def _async(f: MixedFleet, via: int, user: str) -> str:
    r = f.api[via].post("/v1/agents/echo/invoke", params={"async": "true"}, json={"message": "a", "user": user})
    ex = _ok(r, 202)

    def done() -> Any:
        got = _ok(f.api[via].get(f"/v1/executions/{ex['id']}"))
        return got if got["status"] not in ("queued", "running") else None
    got = _until(done, "the async turn to end", 60)
    assert got["status"] == "succeeded", got
    return f"{got['status']}: {got.get('result')}"


def _moved(f: MixedFleet, user: str, src: int, dst: int, to: str) -> str:
    before = f.reply(src, user)[0]
    f.sleep(src, user)
    after, by = f.reply(dst, user)
    rec = f.record(user)
    n0, n1 = int(before.split(":")[0].split()[-1]), int(after.split(":")[0].split()[-1])
    assert rec.host == to and n1 == n0 + 1, (before, after, rec.host, by)
    return f"{before!r} then {after!r} on {rec.host} (epoch {rec.lease_epoch})"


def _deployed(f: MixedFleet, via: int, user_via: int, user: str, text: str) -> str:
    f.deploy(via, text)
    reply, by = f.reply(user_via, user)
    assert reply.startswith(text), reply
    return f"{reply!r} on {f.record(user).host}"
