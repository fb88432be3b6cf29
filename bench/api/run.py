"""API benchmark: what moorage adds to a turn over the bare channel round trip, and throughput over HTTP.

An echo agent (``return message``), awake. Two hosts, both real:

* an in-process ``Host`` (process sandboxes, SQLite) gives the baseline — ``sandbox.channel.call("agent.turn")``
  straight to the awake sandbox — and ``Runtime.invoke`` on the very same sandbox;
* a ``moorage up`` server process on its own data dir serves the HTTP API on 127.0.0.1.

(a) Turn overhead: direct channel call, ``Runtime.invoke`` and one HTTP ``POST /v1/agents/{a}/invoke``,
interleaved in a shuffled order, one at a time. (b) Throughput: N concurrent users spread over several
agents, a bounded closed-loop load generator (httpx on loopback) against the server, and the same N users'
turns sent as direct channel calls in the same run as the baseline.

Writes bench/results/latest/api.{md,json}; the last line printed is the headline.

    .venv/bin/python bench/api/run.py [--reps 200] [--users 12] [--agents 3] [--requests 600] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from moorage import __version__
from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.runtime.host import Host
from moorage.store import EntityKey

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "store"))
from report import latency_summary  # noqa: E402  (bench/store/report.py: what the areas share)

OUT = ROOT / "bench" / "results" / "latest"
AGENT = "async def on_message(ctx, message):\n    return message\n"


def _agent_dir(base: Path, name: str) -> Path:
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n'
                                    '[agent.lifecycle]\nusers = "auto"\nconcurrency = "parallel"\n')
    (d / "agent.py").write_text(AGENT)
    return d


def _tar(d: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(d.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


class Server:
    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port),
               "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_LOG_LEVEL": "warning"}
        self.log = open(data.parent / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=env, cwd=ROOT,
                                     stdout=self.log, stderr=self.log)
        self.data = data

    async def ready(self) -> str:
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient() as c:
            while True:
                try:
                    if (await c.get(f"{self.url}/healthz", timeout=1)).status_code == 200:
                        return (self.data / "local-admin.key").read_text().strip()
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moorage up did not come up; see server.log")
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def _closed_loop(users: list[Any], total: int, call: Callable[[Any, int], Awaitable[None]]) -> dict[str, Any]:
    """Each user sends its next turn when its previous one answered, until ``total`` turns were sent."""
    lat: list[float] = []
    sent = 0
    errors = 0

    async def worker(u: Any) -> None:
        nonlocal sent, errors
        while sent < total:
            sent += 1
            i = sent
            t0 = time.perf_counter()
            try:
                await call(u, i)
            except Exception:  # noqa: BLE001 - counted, reported
                errors += 1
                continue
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(u) for u in users))
    wall = time.perf_counter() - t0
    return {"turns": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall, **latency_summary(lat)}


async def run(reps: int, n_users: int, n_agents: int, requests: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="moorage-bench-api-"))
    agents = [f"echo{i}" for i in range(n_agents)]
    dirs = [_agent_dir(tmp / "agents", a) for a in agents]
    users = [(agents[i % n_agents], f"user{i}") for i in range(n_users)]

    cfg = Config(data_dir=tmp / "inproc", sandbox_driver="process")
    host = Host.open(cfg)
    await host.start()
    server = Server(tmp / "server")
    try:
        _, key = host.store.operator.create_tenant("bench")
        principal = host.store.authenticate(key.secret)
        ts = host.store.tenant(principal)
        for d in dirs:
            await host.runtime.deploy(principal, d)
        # Wake every user's sandbox in-process (first turn) and find it for the direct calls.
        direct: dict[tuple[str, str], Callable[[str], Awaitable[Any]]] = {}
        for agent, user in users:
            r = await host.runtime.invoke(principal, EntityKey(agent, user), "warm")
            assert r.reply == "warm"
            (rec,) = [s for s in ts.sandboxes.list(agent_id=agent) if s.scope.user == user]
            sb = await host.driver.open(rec.id)
            dep = ts.agents.get(agent).live_deployment

            def make(sb: Any = sb, dep: str = dep, agent: str = agent, user: str = user) -> Callable[[str], Awaitable[Any]]:
                async def call(msg: str) -> Any:
                    out = await sb.channel.call("agent.turn", {"deployment_id": dep, "turn_id": "bench-direct",
                                                               "message": msg, "entity": {"agent": agent, "user": user,
                                                                                          "session": "default"}},
                                                timeout=60)
                    assert out["reply"] == msg, out
                return call

            direct[(agent, user)] = make()

        api_key = await server.ready()
        headers = {"Authorization": f"Bearer {api_key}"}
        limits = httpx.Limits(max_connections=n_users + 4, max_keepalive_connections=n_users + 4)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120, limits=limits) as client:
            for d, a in zip(dirs, agents):
                r = await client.post(f"/v1/agents/{a}/deployments", content=_tar(d),
                                      headers={"Content-Type": "application/gzip"})
                r.raise_for_status()

            async def http_turn(agent: str, user: str, msg: str) -> None:
                r = await client.post(f"/v1/agents/{agent}/invoke", json={"user": user, "message": msg})
                r.raise_for_status()
                assert r.json()["reply"] == msg

            for agent, user in users:
                await http_turn(agent, user, "warm")

            # (a) one turn at a time, the three paths interleaved in a shuffled order
            a0, u0 = users[0]
            paths: dict[str, Callable[[int], Awaitable[Any]]] = {
                "direct": lambda i: direct[(a0, u0)](f"m{i}"),
                "runtime": lambda i: host.runtime.invoke(principal, EntityKey(a0, u0), f"m{i}"),
                "http": lambda i: http_turn(a0, u0, f"m{i}"),
            }
            samples: dict[str, list[float]] = {k: [] for k in paths}
            rng = random.Random(7)
            for _ in range(10):  # warm-up
                for f in paths.values():
                    await f(0)
            for i in range(reps):
                order = list(paths)
                rng.shuffle(order)
                for k in order:
                    t0 = time.perf_counter()
                    await paths[k](i)
                    samples[k].append(time.perf_counter() - t0)
            single = {k: latency_summary(v) for k, v in samples.items()}

            # (b) N concurrent users over several agents: HTTP against the server, direct channel as baseline
            async def http_call(u: tuple[str, str], i: int) -> None:
                await http_turn(u[0], u[1], f"load{i}")

            async def direct_call(u: tuple[str, str], i: int) -> None:
                await direct[u](f"load{i}")

            load_direct = await _closed_loop(users, requests, direct_call)
            load_http = await _closed_loop(users, requests, http_call)
            load_direct2 = await _closed_loop(users, requests, direct_call)  # bracket the HTTP run
    finally:
        server.stop()
        for sid in await host.driver.list():
            try:
                await (await host.driver.open(sid)).stop()
            except Exception:  # noqa: BLE001
                pass
        await host.close()
        await _stop_server_sandboxes(tmp / "server")

    d = single["direct"]
    return {
        "moorage": __version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "driver": "process", "store": "sqlite", "reps": reps, "users": n_users, "agents": n_agents,
        "requests": requests, "single": single,
        "added_runtime_p50_ms": single["runtime"]["p50_ms"] - d["p50_ms"],
        "added_runtime_p99_ms": single["runtime"]["p99_ms"] - d["p99_ms"],
        "added_http_p50_ms": single["http"]["p50_ms"] - d["p50_ms"],
        "added_http_p99_ms": single["http"]["p99_ms"] - d["p99_ms"],
        "load_http": load_http, "load_direct": load_direct, "load_direct_after": load_direct2,
    }


async def _stop_server_sandboxes(data: Path) -> None:
    """`moorage up` detaches from its sandboxes on shutdown (they are meant to outlive it); stop them."""
    from moorage.sandbox.process import ProcessDriver

    cfg = Config(data_dir=data, sandbox_driver="process")
    drv = ProcessDriver(cfg.sandboxes_dir, cfg)
    for sid in await drv.list():
        try:
            await (await drv.open(sid)).stop()
        except Exception:  # noqa: BLE001
            pass
    await drv.close()


def report(res: dict[str, Any]) -> str:
    s = res["single"]
    lines = [
        "# API: turn overhead over the channel round trip, and throughput with concurrent users", "",
        f"moorage {res['moorage']}, Python {res['python']}, {res['cpus']} CPUs (shared, noisy), driver "
        f"`{res['driver']}`, store {res['store']}. Echo agent (`return message`), awake. Baseline in the same run: "
        "`sandbox.channel.call(\"agent.turn\")` straight to the awake sandbox (no run, no journal, no memory, no "
        "router). `Runtime.invoke` runs on the same sandbox; HTTP goes to a `moorage up` server process on loopback.", "",
        f"## (a) One turn at a time, interleaved (shuffled), {res['reps']} each", "",
        "| path | n | p50 | p99 | min | max |", "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"direct": "direct channel call (baseline)", "runtime": "Runtime.invoke (in-process)",
             "http": "HTTP POST /v1/agents/{a}/invoke"}
    for k in ("direct", "runtime", "http"):
        x = s[k]
        lines.append(f"| {names[k]} | {x['n']} | {x['p50_ms']:.2f} ms | {x['p99_ms']:.2f} ms | {x['min_ms']:.2f} ms | {x['max_ms']:.2f} ms |")
    lines += ["", f"Added over the channel round trip: runtime p50 {res['added_runtime_p50_ms']:.2f} ms, "
              f"p99 {res['added_runtime_p99_ms']:.2f} ms; HTTP end to end p50 {res['added_http_p50_ms']:.2f} ms, "
              f"p99 {res['added_http_p99_ms']:.2f} ms.", "",
              f"## (b) {res['users']} concurrent users over {res['agents']} agents, closed loop, {res['requests']} turns per run", "",
              "| path | turns | errors | turns/s | p50 | p99 | min | max |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, x in (("direct channel calls (baseline, before)", res["load_direct"]),
                    ("HTTP invoke via moorage up", res["load_http"]),
                    ("direct channel calls (baseline, after)", res["load_direct_after"])):
        lines.append(f"| {name} | {x['turns']} | {x['errors']} | {x['rps']:.0f} | {x['p50_ms']:.1f} ms | "
                     f"{x['p99_ms']:.1f} ms | {x['min_ms']:.1f} ms | {x['max_ms']:.1f} ms |")
    base = (res["load_direct"]["rps"] + res["load_direct_after"]["rps"]) / 2
    lines += ["", f"HTTP throughput is {res['load_http']['rps'] / base:.2f}x the direct-channel baseline "
              f"({res['load_http']['rps']:.0f} vs {base:.0f} turns/s). The load generator shares the box's CPUs "
              "with the server and the sandboxes; every HTTP turn is a durable run (journal, episodic memory, "
              "spans) while the baseline is a bare channel call."]
    return "\n".join(lines) + "\n"


def headline(res: dict[str, Any]) -> str:
    s = res["single"]
    lh = res["load_http"]
    base = (res["load_direct"]["rps"] + res["load_direct_after"]["rps"]) / 2
    return (f"api turn p50 {s['http']['p50_ms']:.1f} ms over HTTP vs {s['direct']['p50_ms']:.2f} ms direct channel "
            f"(adds p50 {res['added_http_p50_ms']:.1f} ms p99 {res['added_http_p99_ms']:.1f} ms; runtime alone adds "
            f"p50 {res['added_runtime_p50_ms']:.1f} ms); {res['users']} users: {lh['rps']:.0f} turns/s "
            f"p50 {lh['p50_ms']:.0f} ms p99 {lh['p99_ms']:.0f} ms, {lh['rps'] / base:.2f}x direct ({base:.0f}/s), "
            f"errors {lh['errors']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.users, args.requests = 30, 6, 120
    res = asyncio.run(run(args.reps, args.users, args.agents, args.requests))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "api.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "api.md").write_text(report(res))
    print(report(res))
    print(headline(res))
    return 0 if res["load_http"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
