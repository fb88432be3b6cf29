"""Scale audit: a host whose store holds a year of use (50,000 end-users), against the same host on a small store.

Seeds a data directory through a real ``moorage up`` (process driver): an echo agent, a webhook to a local
receiver, a template user's turns (sync and async, a fact, a checkpoint). Copies that user's rows to ``--small``
users (bench/scale/fill.py), measures, copies on to ``--users`` users plus one user with ``--events`` events,
and measures again: through HTTP and the SDK (``moorage.client``), with every SQL statement the host runs logged
(bench/scale/traced_up.py) so each request's query count is known and each statement's SQLite plan is read
(bench/scale/plans.py). ``--before-src DIR`` also measures the big store with another checkout's ``src`` (the
code before a fix) first, on the same data, in the same run.

    .venv/bin/python bench/scale/run.py [--users 50000] [--small 100] [--events 20000] [--before-src DIR]

Writes bench/results/latest/scale.{md,json}.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "scale"))
import fill  # noqa: E402
import plans  # noqa: E402
from moorage.api.pagination import encode_cursor  # noqa: E402
from moorage.client import Client  # noqa: E402
from moorage.devservices.postgres import free_port  # noqa: E402

OUT = ROOT / "bench" / "results" / "latest"
TEMPLATE = "tmpl0000"  # a clone is u0000001…: the same length, so ids inside JSON keep their shape
HEAVY = "u0000007"
WORDS = ("invoice refund shipping order parcel delay address payment card account password email weather "
         "holiday flight hotel booking museum ticket concert recipe garden").split()


class Receiver:
    """A webhook receiver that answers 200 (deliveries end delivered, as a working integration's do)."""

    def __init__(self) -> None:
        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Host:
    """``moorage up`` (process driver) on ``data``, its SQL logged to ``sql_log``; ``up_s``: start until served."""

    def __init__(self, data: Path, sql_log: Path, src: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data.parent / "host.log"
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port), "MOORAGE_HOST_ID": "h1",
               "MOORAGE_HOST_URL": self.url, "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_SCALE_SQL_LOG": str(sql_log),
               "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",  # the local webhook receiver
               "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'bench' / 'scale'}"}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scale" / "traced_up.py"), "up"], env=env,
                                     cwd=ROOT, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.perf_counter() - t0 > 1800:
                raise RuntimeError(f"moorage up did not come up: {self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        self.up_s = time.perf_counter() - t0
        self.key = (data / "local-admin.key").read_text().strip()
        self.sdk = Client(self.url, self.key, timeout_s=600)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=600)

    def stop(self) -> None:
        self.sdk.close()
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def swept(data: Path, src: Path) -> dict[str, Any]:
    """``moorage store sweep`` of ``data``: a host that ran all year swept every five minutes, so a copied row that
    its retention would have deleted (an Idempotency-Key's answer of last spring) is not there to measure."""
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-m", "moorage.cli.main", "store", "sweep", "--json"], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def seed(base: Path, data: Path, receiver: Receiver, src: Path) -> dict[str, Any]:
    agent = base / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text("async def on_message(ctx, message):\n    return 'echo: ' + message\n")
    host = Host(data, base / "seed.sql", src)
    try:
        host.sdk.deploy("echo", agent)
        hook = host.sdk.create_webhook("echo", receiver.url)
        host.sdk.put_user("echo", TEMPLATE, metadata={"plan": "pro"})
        for i in range(3):
            host.sdk.invoke("echo", f"hello {i}, my name is {TEMPLATE} and I need a refund", user=TEMPLATE)
        for i in range(2):
            ex = host.sdk.invoke_async("echo", f"later {i}: where is my parcel", user=TEMPLATE)
            host.sdk.wait_execution(ex["id"], timeout_s=120)
        host.sdk.take_checkpoint("echo", TEMPLATE, name="before-upgrade")
        deadline = time.time() + 60  # every delivery sent
        while time.time() < deadline:
            rows = host.sdk.list_deliveries("echo", hook["id"], limit=100)["data"]
            if rows and all(d["status"] == "delivered" for d in rows):
                break
            time.sleep(0.5)
    finally:
        host.stop()
    return {"webhook": hook["id"]}


def _timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of ``reps`` calls of ``fn`` and its last answer."""
    xs, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs), out


class Sql:
    """The host's SQL log: the statements a request added (background loops' too, so counts are an upper bound)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, mark: int) -> list[str]:
        """Statements logged since ``mark``: SQLite traces a statement again at each trigger it fires (a DELETE of
        1,000 rows is logged 1,000 times in a row) and traces the triggers' and the full-text index's own
        statements ("-- ..."); those count once, as the statement that ran them."""
        out: list[str] = []
        with open(self.path, "rb") as f:
            f.seek(mark)
            for ln in f.read().decode(errors="replace").splitlines():
                sql = ln.split("\t", 1)[1] if "\t" in ln else ""
                if not sql or sql.startswith(("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA", "SAVEPOINT", "RELEASE", "--")):
                    continue
                if not out or out[-1] != ln:
                    out.append(ln)
        return out


def _mid_row(data: Path, sql: str) -> tuple:
    con = sqlite3.connect(f"file:{fill.tenant_db(data)}?mode=ro", uri=True)
    try:
        (n,) = con.execute(f"SELECT COUNT(*) FROM ({sql})").fetchone()
        return con.execute(f"{sql} LIMIT 1 OFFSET ?", (n // 2,)).fetchone()
    finally:
        con.close()


def measure(label: str, base: Path, data: Path, src: Path, hook: str, users: int, reps: int,
            forget: list[str], code: str) -> dict[str, Any]:
    """Every figure of one phase; ``code`` names its new users (new<code><n>), unique to the phase."""
    print(f"[{label}] moorage up on {users} users ({src})", flush=True)
    sql_log = base / f"{label}.sql"
    sql_log.unlink(missing_ok=True)
    host = Host(data, sql_log, src)
    sql = Sql(sql_log)
    res: dict[str, Any] = {"users": users, "src": str(src), "up_s": host.up_s, "requests": {}}
    try:
        def req(name: str, fn: Callable[[], Any], n: int = reps) -> Any:
            m = sql.mark()
            t0 = time.perf_counter()
            first = fn()
            first_s = time.perf_counter() - t0
            stmts = sql.since(m)
            med, _ = _timed(fn, n - 1) if n > 1 else (first_s, None)
            res["requests"][name] = {"first_s": first_s, "median_s": statistics.median([first_s, med]) if n > 1 else first_s,
                                     "queries": len(stmts)}
            print(f"  {name}: {first_s * 1e3:.1f} ms first, {med * 1e3:.1f} ms median, {len(stmts)} queries", flush=True)
            return first

        c, h = host.sdk, host.http
        for i in range(3):
            req(f"first turn of a new user #{i + 1}", lambda i=i: c.invoke("echo", "hello", user=f"new{code}{i}"), 1)
        req("turn of an existing user (wakes it)", lambda: c.invoke("echo", "again", user=TEMPLATE), 1)
        req("turn of an existing user (awake)", lambda: c.invoke("echo", "again", user=TEMPLATE))
        mid_user = f"u{users // 2:07d}"
        req("GET users: first page", lambda: c.list_users("echo", limit=50))
        req("GET users: deep page", lambda: c.list_users("echo", limit=50, cursor=encode_cursor({"after": mid_user})))
        req("GET users: metadata filter", lambda: c.list_users("echo", metadata={"plan": "free"}, limit=50))
        req("GET instances: first page", lambda: c.list_sandboxes(limit=50))
        a, i_ = _mid_row(data, "SELECT last_active, id FROM sandboxes ORDER BY last_active DESC, id DESC")
        req("GET instances: deep page", lambda: c.list_sandboxes(limit=50, cursor=encode_cursor({"a": a, "i": i_})))
        req("GET checkpoints of a user", lambda: c.list_checkpoints("echo", TEMPLATE, limit=50))
        req("GET traces: first page", lambda: c.list_spans(limit=50))
        t, s = _mid_row(data, "SELECT start_ts, span_id FROM spans ORDER BY start_ts DESC, span_id DESC")
        req("GET traces: deep page", lambda: c.list_spans(limit=50, cursor=encode_cursor({"t": t, "s": s})))
        req("GET webhook deliveries: first page", lambda: c.list_deliveries("echo", hook, limit=50))
        (b,) = _mid_row(data, "SELECT created_at FROM webhook_deliveries ORDER BY created_at DESC")
        req("GET webhook deliveries: deep page",
            lambda: c.list_deliveries("echo", hook, limit=50, cursor=encode_cursor({"before": b})))
        req("GET workflows: first page", lambda: c.list_workflows(limit=50))
        req("GET usage: tenant totals", lambda: c.usage())
        req("GET usage: one user's totals", lambda: c.usage(user=mid_user))
        req("GET usage: by day", lambda: c.usage(by_day=True, since=time.time() - 30 * 86400))
        req("dashboard: home (fleet, waiting runs)",
            lambda: (h.get("/v1/fleet").raise_for_status(), h.get("/v1/workflows?status=waiting&limit=50").raise_for_status()))
        req("dashboard: agent page",
            lambda: [h.get(p).raise_for_status() for p in ("/v1/agents/echo", "/v1/agents/echo/users?limit=200",
                                                           "/v1/fleet?agent=echo&limit=1")])
        req("dashboard: user page",
            lambda: [h.get(p).raise_for_status() for p in (
                f"/v1/agents/echo/users/{mid_user}", f"/v1/agents/echo/sessions?user={mid_user}&limit=100",
                "/v1/workflows?status=waiting&agent=echo&limit=500",
                f"/v1/agents/echo/users/{mid_user}/checkpoints?limit=20")])
        req("dashboard: traces page", lambda: h.get("/v1/traces?limit=500").raise_for_status())
        req(f"memory search of a user with many events ({HEAVY})",
            lambda: c.search_events("echo", HEAVY, "refund parcel", k=10))
        for n, u in enumerate(forget):
            req(f"forget one user #{n + 1}", lambda u=u: c.delete_user("echo", u), 1)
        res["sql_log"] = str(sql_log)
    finally:
        host.stop()
    again = Host(data, base / f"{label}-restart.sql", src)  # a start with nothing to migrate
    res["up_again_s"] = again.up_s
    again.stop()
    # The stopped host's data: an offline `moorage backup`, and a retention sweep of that copy (the data measured
    # next stays as it is).
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "PYTHONPATH": str(src)}
    dest = base / f"backup-{label}"
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moorage.cli.main", "backup", str(dest)], env=env, check=True,
                   capture_output=True)
    res["backup_s"] = time.perf_counter() - t0
    res["backup_bytes"] = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    m = sql.mark()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "scale" / "traced_up.py"), "store", "sweep", "--json"],
                         env={**env, "MOORAGE_DATA_DIR": str(dest), "MOORAGE_SCALE_SQL_LOG": str(sql_log),
                              "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'bench' / 'scale'}"},
                         check=True, capture_output=True, text=True)
    res["sweep_s"] = time.perf_counter() - t0
    res["sweep"] = json.loads(out.stdout.strip().splitlines()[-1])
    res["sweep_queries"] = len(sql.since(m))
    shutil.rmtree(dest, ignore_errors=True)
    print(f"  backup {res['backup_s']:.1f} s, sweep {res['sweep_s']:.1f} s {res['sweep']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=50_000)
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before-src", type=Path, help="another checkout's src: the big store measured with it first")
    ap.add_argument("--keep", action="store_true", help="keep the data directory (its path is printed)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="moorage-scale-"))
    data = base / "data"
    receiver = Receiver()
    print(f"data directory {data}", flush=True)
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": {}}
    try:
        first_src = (args.before_src or ROOT / "src").resolve()  # the store stays at the older schema until `big`
        t0 = time.perf_counter()
        hook = seed(base, data, receiver, first_src)["webhook"]
        out["seed_s"] = time.perf_counter() - t0
        con = sqlite3.connect(fill.tenant_db(data))
        out["template_rows"] = {t: len(r[1]) for t, r in fill.template_rows(con, TEMPLATE).items()}
        con.close()
        fill.clone(data, TEMPLATE, args.small)
        swept(data, first_src)
        small = base / "data-small"  # measured on a copy: `data` grows on from here
        shutil.copytree(data, small, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
        out["phases"]["small"] = measure("small", base, small, ROOT / "src", hook, args.small, args.reps,
                                         [f"u{args.small // 2 + k:07d}" for k in (1, 2, 3)], "s")
        out["phases"]["small"]["tables"] = fill.table_counts(small)
        shutil.rmtree(small, ignore_errors=True)
        t0 = time.perf_counter()
        fill.clone(data, TEMPLATE, args.users - args.small, first=args.small + 1)
        fill.add_events(data, f"session:echo/{HEAVY}/default", args.events, words=WORDS)
        out["fill_s"] = time.perf_counter() - t0
        out["pre_sweep"] = swept(data, first_src)
        out["tables"] = fill.table_counts(data)
        out["store_bytes"] = sum(p.stat().st_size for p in (data / "store").rglob("*") if p.is_file())
        print(f"filled in {out['fill_s']:.0f} s: {out['tables']}", flush=True)
        if args.before_src:
            out["phases"]["big-before"] = measure("big-before", base, data, first_src, hook, args.users,
                                                  args.reps, [f"u{args.users // 3 + k:07d}" for k in (1, 2, 3)], "b")
            out["plans_before"] = plans.read(data, Path(out["phases"]["big-before"]["sql_log"]))
        out["phases"]["big"] = measure("big", base, data, ROOT / "src", hook, args.users, args.reps,
                                       [f"u{args.users // 4 + k:07d}" for k in (1, 2, 3)], "a")
        out["plans"] = plans.read(data, Path(out["phases"]["big"]["sql_log"]))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(json.dumps(out, indent=1, default=str))
    (OUT / "scale.md").write_text(plans.report(out))
    print((OUT / "scale.md").read_text())


if __name__ == "__main__":
    main()
