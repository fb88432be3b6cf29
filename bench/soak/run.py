"""Soak: does a ``moorage up`` host that runs for a long time leak? A mixed workload through the SDK, sampled.

Starts ``moorage up`` (embedded defaults, SQLite, a temp data dir; ``bench/soak/host.py`` adds a thread that counts
the host's asyncio tasks) and, for ``--minutes``, drives rounds of: new users' first turns, awake turns, turns on
users put to sleep (wake) and on users the idle policy put to sleep, streams the client abandons halfway, async
turns with webhooks to a local receiver, execs (attached, detached, cancelled), file listings and reads, files
written by turns, checkpoints, rollbacks and forks, MCP calls, dashboard pages and listings, redeploys and agent
rollbacks, and forgets of the users of rounds before. Every ``--sample-s`` it records the host's RSS, fds, threads,
asyncio tasks, child processes, the files and bytes of the data dir and of the host's own TMPDIR, and the SQLite
WAL. At the end every user is forgotten, the host is left idle ``--settle-s``, and the figures are compared with
the baseline taken after a warm-up round (forgotten too); the store's rows per table likewise.

    .venv/bin/python bench/soak/run.py [--driver process|microvm] [--minutes 12] [--users 4] [--out NAME]

Writes bench/results/latest/<out>.{md,json} (default ``soak-<driver>``); the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from moorage.cli.up import tar_dir
from moorage.client import AsyncClient
from moorage.devservices.postgres import free_port

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"
AGENT = "soak"
AGENT_PY = '''\
import asyncio

VERSION = {version}

async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    if message.startswith("stream"):
        for i in range(40):
            await ctx.emit("progress", i)
            await asyncio.sleep(0.05)
    if message.startswith("write"):
        ctx.files.write(f"blob-{{n % 3}}.bin", "x" * 32768)
    return f"v{{VERSION}} {{n + 1}}: {{message}}"
'''
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2025-11-25"}


def agent_dir(base: Path, version: int) -> Path:
    d = base / f"v{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text(f'[agent]\nname = "{AGENT}"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:20"\npool = 1\n')
    (d / "agent.py").write_text(AGENT_PY.format(version=version))
    return d


class Receiver:
    """The webhook endpoint, on loopback: counts deliveries."""

    def __init__(self) -> None:
        self.count = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.count += 1
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# -- what is sampled ------------------------------------------------------------------------------------------

def _descendants(pid: int) -> list[tuple[int, str]]:
    kids: dict[int, list[tuple[int, str]]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append((int(p.name), comm))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _tree(path: Path, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    files = size = 0
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if d not in skip and not os.path.islink(os.path.join(root, d))]
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:
                continue
            files += 1
            size += st.st_blocks * 512  # on disk (sparse RAM files and qcow2 count what they hold)
    return files, size


#: glibc's thread arenas are heaps of at most 64 MiB, each mapped at an address aligned to that size.
ARENA_HEAP = 64 << 20


def smaps(pid: int) -> dict[str, float]:
    """The host's anonymous resident memory by kind of mapping (MiB): ``brk`` (glibc's main arena), ``arenas``
    (its thread arenas), ``pymalloc`` (CPython's 1 MiB object arenas), ``stacks`` (8 MiB thread stacks),
    ``other`` (large malloc blocks mapped one by one, memfd or library mappings); and ``file`` (file-backed)."""
    out = dict.fromkeys(("brk", "arenas", "pymalloc", "stacks", "other", "file"), 0.0)
    kind = ""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return out
    size = 0
    for ln in text.splitlines():
        head = ln.split(None, 5)
        if head and "-" in head[0] and not head[0].endswith(":"):
            start = int(head[0].split("-")[0], 16)
            name = head[5] if len(head) > 5 else ""
            kind = ("brk" if name == "[heap]" else "file" if name.startswith("/") else
                    "other" if name else "arenas" if start % ARENA_HEAP == 0 else "?")
        elif ln.startswith("Size:"):
            size = int(ln.split()[1])
        elif ln.startswith("Rss:"):
            k = kind if kind != "?" else ("pymalloc" if size == 1024 else "stacks" if size == 8192 else "other")
            out[k] = out.get(k, 0.0) + int(ln.split()[1]) / 1024
    return out


def sample(pid: int, data: Path, tmp: Path, tasks_file: Path) -> dict[str, Any]:
    status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
    kids = _descendants(pid)
    files, size = _tree(data, skip=("images",))
    tmp_files, tmp_size = _tree(tmp)
    wal = sum(p.stat().st_size for p in data.glob("store/**/*-wal"))
    last: dict[str, Any] = {}
    holdings: dict[str, int] = {}
    malloc: dict[str, float] = {}
    try:
        lines = tasks_file.read_text().splitlines()
        last = json.loads(lines[-1])
        walk = next(json.loads(ln) for ln in reversed(lines) if '"holdings"' in ln)
        holdings, malloc = walk["holdings"], walk.get("malloc") or {}
    except (OSError, IndexError, ValueError, StopIteration):
        pass
    kib = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem") if k in status}
    return {"t": time.time(), "rss_mib": kib["VmRSS"] / 1024, "rss_anon_mib": kib.get("RssAnon", 0) / 1024,
            "rss_file_mib": kib.get("RssFile", 0) / 1024, "rss_shmem_mib": kib.get("RssShmem", 0) / 1024,
            "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "tasks": last.get("tasks"), "task_top": last.get("top"), "thread_names": last.get("thread_names"),
            "children": len(kids), "child_kinds": dict(Counter(c for _, c in kids)), "data_files": files,
            "data_mib": size / 2**20, "tmp_files": tmp_files, "tmp_mib": tmp_size / 2**20, "wal_mib": wal / 2**20,
            "fd_kinds": _fd_kinds(pid), "holdings": holdings, "malloc": malloc, "smaps": smaps(pid)}


def _fd_kinds(pid: int) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":")[0] if ":" in target and not target.startswith("/") else
              ("file:" + Path(target).parent.name if target.startswith("/") else target)] += 1
    return dict(kinds.most_common(12))


def rows(data: Path) -> dict[str, int]:
    """Rows per table over the store's databases (the control database and each tenant's)."""
    out: Counter[str] = Counter()
    for db in sorted(data.glob("store/**/*.db")):
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        try:
            names = [r[0] for r in con.execute("select name from sqlite_master where type='table'")]
            for n in names:
                out[n] += con.execute(f'select count(*) from "{n}"').fetchone()[0]
        finally:
            con.close()
    return dict(out)


# -- the workload ---------------------------------------------------------------------------------------------

class Workload:
    def __init__(self, c: AsyncClient, url: str, key: str, base: Path, receiver: Receiver) -> None:
        self.c, self.url, self.key, self.base, self.receiver = c, url, key, base, receiver
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.error_samples: dict[str, str] = {}
        self.version = 1
        self.seq = 0
        self.live: list[str] = []  # users not forgotten yet
        self.metrics_token = ""

    async def op(self, name: str, coro: Any) -> Any:
        try:
            out = await coro
            self.ops[name] += 1
            return out
        except Exception as e:  # noqa: BLE001 - counted and reported; the soak goes on
            self.errors[name] += 1
            self.error_samples.setdefault(name, f"{type(e).__name__}: {str(e)[:200]}")
            return None

    async def sandbox(self, user: str) -> str | None:
        u = await self.c.get_user(AGENT, user)
        return (u.get("instance") or {}).get("sandbox_id")

    async def abandoned_stream(self, user: str) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"},
                                     timeout=60) as h:
            async with h.stream("POST", f"/v1/agents/{AGENT}/invoke", params={"stream": "true"},
                                json={"message": "stream please", "user": user},
                                headers={"accept": "text/event-stream"}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("event:"):
                        seen += 1
                    if seen >= 3:
                        break  # the client goes away halfway

    async def mcp(self, user: str) -> None:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "send_message", "arguments": {"message": "hi over mcp", "user": user}}}
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as h:
            r = await h.post(f"/mcp/{AGENT}", json=body, headers={**MCP_HEADERS, "Authorization": f"Bearer {self.key}"})
            r.raise_for_status()

    async def dashboard(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as h:
            for p in ("/ui/", "/ui/app.js", "/ui/style.css", "/healthz"):
                (await h.get(p)).raise_for_status()
            (await h.get("/metrics", headers={"Authorization": f"Bearer {self.metrics_token}"})).raise_for_status()
        await self.c.list_sandboxes(agent=AGENT, limit=50)
        await self.c.list_spans(limit=50)
        await self.c.usage()
        await self.c.list_workflows(limit=20)
        await self.c.list_users(AGENT, limit=50)

    async def exec_kinds(self, sid: str) -> None:
        r = await self.c.exec(sid, ["sh", "-c", "echo hello; ls /"])
        assert r.get("exit_code") == 0, r
        ex = await self.c.exec_detached(sid, ["sh", "-c", "sleep 0.2; echo done"])
        await self.c.wait(ex["id"], timeout_s=60, poll_s=0.2)
        ex = await self.c.exec_detached(sid, ["sleep", "30"])
        await asyncio.sleep(0.3)
        await self.c.cancel_execution(ex["id"])

    async def files(self, sid: str) -> None:
        await self.c.list_files(sid, "/")
        await self.c.read_file(sid, "counter.txt")

    async def time_travel(self, user: str) -> str | None:
        cp = await self.c.take_checkpoint(AGENT, user, name=f"cp{self.seq}")
        await self.c.invoke(AGENT, "after checkpoint", user=user)
        cp_id = cp.get("id") or cp.get("checkpoint", {}).get("id")
        await self.c.rollback_checkpoint(AGENT, user, cp_id)
        child = f"{user}-fork"
        await self.c.fork_checkpoint(AGENT, user, cp_id, child)
        await self.c.invoke(AGENT, "hello fork", user=child)
        return child

    async def user_life(self, user: str) -> None:
        """One user's share of a round: first turn, a few awake turns, a stream, sleep+wake, exec, files."""
        c = self.c
        await self.op("first_turn", c.invoke(AGENT, "hello", user=user))
        for i in range(3):
            await self.op("awake_turn", c.invoke(AGENT, f"{'write' if i == 1 else 'tick'} {i}", user=user))
        await self.op("abandoned_stream", self.abandoned_stream(user))
        ex = await self.op("async_turn", c.invoke_async(AGENT, "async hello", user=user))
        if ex:
            await self.op("async_wait", c.wait(ex["id"], timeout_s=120, poll_s=0.3))
        sid = await self.op("get_user", self.sandbox(user))
        if sid:
            await self.op("exec", self.exec_kinds(sid))
            await self.op("files", self.files(sid))
            await self.op("sleep", c.sandbox_action(sid, "sleep"))
            await self.op("wake_turn", c.invoke(AGENT, "after sleep", user=user))
        await self.op("mcp", self.mcp(user))

    async def round(self, n: int, users: int) -> None:
        self.seq = n
        new = [f"u{n}-{i}" for i in range(users)]
        await asyncio.gather(*(self.user_life(u) for u in new))
        self.live += new
        child = await self.op("checkpoint_rollback_fork", self.time_travel(new[0]))
        if child:
            self.live.append(child)
        await self.op("dashboard", self.dashboard())
        # Users of two rounds ago: the idle policy (sleep = fixed:20) has put them to sleep by now; wake one.
        old = [u for u in self.live if u.startswith(f"u{n - 2}-")]
        if old:
            await self.op("idle_wake_turn", self.c.invoke(AGENT, "hello again", user=old[0]))
        if n % 4 == 3:
            self.version += 1
            await self.op("redeploy", self.c.deploy(AGENT, tar_dir(agent_dir(self.base, self.version))))
        if n % 8 == 7:
            await self.op("agent_rollback", self.c.rollback(AGENT))
        # Forget the users of three rounds ago (and their forks).
        gone = [u for u in self.live if u.startswith(f"u{n - 3}-")]
        for u in gone:
            await self.op("forget", self.c.delete_user(AGENT, u))
        self.live = [u for u in self.live if u not in gone]

    async def forget_all(self) -> None:
        for u in list(self.live):
            await self.op("forget", self.c.delete_user(AGENT, u))
        self.live = []


# -- the run --------------------------------------------------------------------------------------------------

async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"moorage-soak-{args.driver}-"))
    data, tmp, tasks_file = work / "data", work / "tmp", work / "tasks.jsonl"
    data.mkdir()
    tmp.mkdir()
    if args.driver == "microvm":
        images = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))
        images.mkdir(parents=True, exist_ok=True)
        (data / "images").symlink_to(images)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(port), "TMPDIR": str(tmp),
           "MOORAGE_SANDBOX_DRIVER": args.driver, "MOORAGE_LOG_LEVEL": "info", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8"}
    log_path = work / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "soak" / "host.py"), str(tasks_file), "up"],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[dict[str, Any]] = []
    receiver = Receiver()
    res: dict[str, Any] = {"driver": args.driver, "minutes": args.minutes, "users_per_round": args.users,
                           "work": str(work)}
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moorage up did not come up; see {log_path}")
            await asyncio.sleep(0.3)
        key = (data / "local-admin.key").read_text().strip()
        async with AsyncClient(url, key, timeout_s=300, max_retries=3) as c:
            w = Workload(c, url, key, work / "agents", receiver)
            w.metrics_token = (data / "api" / "metrics-token").read_text().strip()
            await c.deploy(AGENT, tar_dir(agent_dir(w.base, 1)))
            await c.create_webhook(AGENT, receiver.url)

            async def sampler(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    s = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
                    s["phase"], s["ops"] = phase, sum(w.ops.values())
                    samples.append(s)
                    try:
                        await asyncio.wait_for(stop.wait(), args.sample_s)
                    except asyncio.TimeoutError:
                        pass

            # Warm-up: one round whose users are then forgotten, so lazily made things (pools, caches, the
            # template, the first connection of each kind) are in the baseline, not counted as growth.
            phase = "warmup"
            for n in range(4):
                await w.round(n, 1)
            await w.forget_all()
            await asyncio.sleep(args.settle_s)
            res["baseline"] = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
            res["rows_baseline"] = await asyncio.to_thread(rows, data)
            stop = asyncio.Event()
            phase = "load"
            sampling = asyncio.create_task(sampler(stop))
            t_end = time.monotonic() + args.minutes * 60
            n = 10
            while time.monotonic() < t_end:
                await w.round(n, args.users)
                n += 1
            res["rounds"] = n - 10
            res["at_load_end"] = samples[-1] if samples else None
            phase = "forget"
            await w.forget_all()
            phase = "settle"
            await asyncio.sleep(args.settle_s)
            res["final"] = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
            res["rows_final"] = await asyncio.to_thread(rows, data)
            res["sandboxes_left"] = [(s["id"], s.get("state"), s.get("scope"))
                                     for s in (await c.list_sandboxes(limit=100))["data"]]
            if args.sleepers:
                # What the host keeps per user who is asleep, not forgotten: one turn each, then the idle policy
                # (fixed:20) puts them to sleep; the sample is taken once the object walk ran after that.
                phase = "sleepers"
                for i in range(args.sleepers):
                    await w.op("first_turn", c.invoke(AGENT, "hello", user=f"sleeper{i}"))
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    page = await c.list_sandboxes(agent=AGENT, state="running", limit=100)
                    if not page["data"]:
                        break
                    await asyncio.sleep(2)
                await asyncio.sleep(35)
                res["asleep"] = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
                res["sleepers"] = args.sleepers
                for i in range(args.sleepers):
                    await w.op("forget", c.delete_user(AGENT, f"sleeper{i}"))
                phase = "settle"
                await asyncio.sleep(35)
                res["sleepers_forgotten"] = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
            # Whether what RSS kept is used or only kept by glibc after it was freed: malloc_trim(0) in the host.
            trim = tasks_file.with_name(tasks_file.name + ".trim")
            trim.touch()
            for _ in range(100):
                if not trim.exists():
                    break
                await asyncio.sleep(0.2)
            res["trimmed"] = await asyncio.to_thread(sample, proc.pid, data, tmp, tasks_file)
            res["trim"] = next((json.loads(ln)["trim"] for ln in reversed(tasks_file.read_text().splitlines())
                                if '"trim"' in ln), None)
            stop.set()
            await sampling
            res["ops"], res["errors"], res["error_samples"] = dict(w.ops), dict(w.errors), w.error_samples
            res["webhook_deliveries"] = receiver.count
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        receiver.server.shutdown()
        res["samples"] = samples
        res["log_errors"] = [ln for ln in log_path.read_text(errors="replace").splitlines()
                             if " error " in ln.lower() or "traceback" in ln.lower()][-30:]
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return res


KEYS = ("rss_mib", "rss_anon_mib", "rss_file_mib", "rss_shmem_mib", "fds", "threads", "tasks", "children", "data_files", "data_mib", "tmp_files", "tmp_mib", "wal_mib")


def headline(res: dict[str, Any]) -> str:
    b, f = res["baseline"], res["final"]
    return (f"soak {res['minutes']:g} min ({res['driver']}): rss {f['rss_mib'] - b['rss_mib']:+.1f} MiB, "
            f"fds {f['fds'] - b['fds']:+d}, tasks {(f['tasks'] or 0) - (b['tasks'] or 0):+d}, "
            f"threads {f['threads'] - b['threads']:+d}, children {f['children'] - b['children']:+d}, "
            f"data dir {f['data_mib'] - b['data_mib']:+.1f} MiB ({f['data_files'] - b['data_files']:+d} files), "
            f"tmp {f['tmp_files'] - b['tmp_files']:+d} files after forget")


def report(res: dict[str, Any]) -> str:
    b, f, e = res["baseline"], res["final"], res.get("at_load_end") or res["final"]
    lines = [f"# soak: `moorage up` ({res['driver']} driver), {res['minutes']:g} min of mixed load", "",
             f"{res['rounds']} rounds of {res['users_per_round']} new users each; "
             f"{sum(res['ops'].values())} operations, {sum(res['errors'].values())} failed; "
             f"{res['webhook_deliveries']} webhook deliveries received.", "",
             "| figure | baseline (after warm-up, forgotten) | end of load | after forget + settle | change |",
             "|---|---:|---:|---:|---:|"]
    for k in KEYS:
        if b.get(k) is None:
            continue
        lines.append(f"| {k} | {b[k]:.1f} | {e[k]:.1f} | {f[k]:.1f} | {f[k] - b[k]:+.1f} |")
    lines += ["", "Operations: " + ", ".join(f"{k} {v}" for k, v in sorted(res["ops"].items())),
              "", "Failures: " + (", ".join(f"{k} {v} ({res['error_samples'][k]})" for k, v in res["errors"].items())
                                  or "none"), ""]
    grew = {t: (res["rows_baseline"].get(t, 0), n) for t, n in res["rows_final"].items()
            if n != res["rows_baseline"].get(t, 0)}
    lines += ["Store rows that differ from the baseline after every user was forgotten (table: before → after):", ""]
    lines += [f"- `{t}`: {a} → {z}" for t, (a, z) in sorted(grew.items())] or ["- none"]
    hb, hf = b.get("holdings") or {}, f.get("holdings") or {}
    he = e.get("holdings") or {}
    grown = sorted(((k, hb.get(k, 0), he.get(k, 0), v) for k, v in hf.items() if v > hb.get(k, 0)),
                   key=lambda x: x[2] - x[1], reverse=True)
    lines += ["", "What the host's objects hold (instances of a class, or the summed length of its containers) that "
              "is higher after forget than at the baseline (name: baseline / end of load / after forget):", ""]
    lines += [f"- `{k}`: {a} / {m if he else 'n/a'} / {z}" for k, a, m, z in grown[:40]] or ["- nothing"]
    lines += ["", f"Child processes at the end: {f['child_kinds']}; sandboxes listed: {len(res['sandboxes_left'])}",
              f"Host fds by kind at the end: {f['fd_kinds']} (baseline {b['fd_kinds']})",
              f"asyncio tasks by coroutine at the end: {f['task_top']}",
              f"Host threads by name at the end: {f.get('thread_names')} (baseline {b.get('thread_names')})",
              "", "## Samples", "",
              "| min | phase | ops | rss MiB | fds | threads | tasks | children | data files | data MiB | tmp files | WAL MiB |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    t0 = res["samples"][0]["t"] if res["samples"] else 0
    for s in res["samples"][::max(1, len(res["samples"]) // 40)]:
        lines.append(f"| {(s['t'] - t0) / 60:.1f} | {s['phase']} | {s['ops']} | {s['rss_mib']:.1f} | {s['fds']} | "
                     f"{s['threads']} | {s['tasks']} | {s['children']} | {s['data_files']} | {s['data_mib']:.1f} | "
                     f"{s['tmp_files']} | {s['wal_mib']:.1f} |")
    mem = [x for x in res["samples"] if x.get("malloc") and x.get("smaps")]
    if mem:
        lines += ["", "## Anonymous memory: where it is", "",
                  "The host's anonymous RSS by mapping (`/proc/PID/smaps`: glibc's main heap `brk`, its thread "
                  "`arenas`, CPython's 1 MiB object arenas `pymalloc`, thread `stacks`, `other` anonymous mappings) "
                  "and glibc's allocator summed over its arenas (`mallinfo2`: in use, freed but kept, "
                  "large blocks mapped one by one, number of arenas), MiB:", "",
                  "| min | phase | anon | brk | arenas | pymalloc | stacks | other | malloc in use | malloc free | "
                  "malloc mmapped | arenas (n) |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in [*mem[::max(1, len(mem) // 30)], mem[-1]]:
            m, sm = x["malloc"], x["smaps"]
            lines.append(f"| {(x['t'] - t0) / 60:.1f} | {x['phase']} | {x['rss_anon_mib']:.1f} | {sm['brk']:.1f} | "
                         f"{sm['arenas']:.1f} | {sm['pymalloc']:.1f} | {sm['stacks']:.1f} | {sm['other']:.1f} | "
                         f"{m.get('in_use', 0):.1f} | {m.get('free', 0):.1f} | {m.get('mmapped', 0):.1f} | "
                         f"{m.get('arenas', 0)} |")
    if res.get("trim"):
        tr = res["trim"]
        lines += ["", f"`malloc_trim(0)` in the host at the end: RSS {tr['rss_before_mib']:.1f} → "
                  f"{tr['rss_after_mib']:.1f} MiB ({tr['rss_after_mib'] - tr['rss_before_mib']:+.1f}); glibc's free "
                  f"memory {tr['malloc_before'].get('free', 0):.1f} → {tr['malloc_after'].get('free', 0):.1f} MiB, "
                  f"in use {tr['malloc_before'].get('in_use', 0):.1f} MiB; RSS after the trim "
                  f"{res['trimmed']['rss_mib'] - b['rss_mib']:+.1f} MiB from the baseline."]
    if res.get("sleepers"):
        a, z, n = res["asleep"], res["sleepers_forgotten"], res["sleepers"]
        ha, hz = a.get("holdings") or {}, z.get("holdings") or {}
        per = sorted(((k, (v - hz.get(k, 0)) / n) for k, v in ha.items() if v - hz.get(k, 0) >= n),
                     key=lambda x: -x[1])
        lines += ["", f"## Users asleep, not forgotten ({n} users, one turn each, then put to sleep by the idle policy)",
                  "", f"RSS {a['rss_mib']:.1f} MiB with them asleep, {z['rss_mib']:.1f} MiB once they were forgotten "
                  f"({(a['rss_mib'] - z['rss_mib']) * 1024 / n:+.1f} KiB per asleep user); fds {a['fds']} / {z['fds']}; "
                  f"child processes {a['children']} / {z['children']}.", "",
                  "What the host's objects hold per asleep user (gone once forgotten):", ""]
        lines += [f"- `{k}`: {v:.1f}" for k, v in per[:20]] or ["- nothing"]
    if res["log_errors"]:
        lines += ["", "Error lines in the host log (last 30):", "", "```", *res["log_errors"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--driver", default="process", choices=("process", "microvm"))
    p.add_argument("--minutes", type=float, default=12)
    p.add_argument("--users", type=int, default=4, help="new users per round")
    p.add_argument("--sample-s", type=float, default=10)
    p.add_argument("--settle-s", type=float, default=45, help="idle time before the baseline and the final sample")
    p.add_argument("--sleepers", type=int, default=20, help="users left asleep at the end, to see what each costs")
    p.add_argument("--out", default="")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data dir, host log, task samples)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 minutes, 2 users a round, 4 sleepers")
    args = p.parse_args()
    if args.quick:
        args.minutes, args.users, args.sleepers, args.settle_s = 2, 2, 4, 35
    res = asyncio.run(run(args))
    name = args.out or f"soak-{args.driver}"
    OUT.mkdir(parents=True, exist_ok=True)
    text = report(res) + "\n" + headline(res)
    (OUT / f"{name}.md").write_text(text + "\n")
    if res.get("at_load_end") is not None:
        res["at_load_end"] = dict(res["at_load_end"])  # a copy: the samples' holdings go below, its stay
    for s in res["samples"]:  # the objects' holdings are kept for the named samples only (a few KiB each)
        s.pop("holdings", None)
    (OUT / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
