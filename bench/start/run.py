"""Start audit: how long a restarted host keeps its users waiting, from ``moorage up``'s process start to its first
answers, on a small store and on a big one, with this checkout and (``--before-src``) another one, in one run.

A real ``moorage up`` (SQLite store) deploys an echo agent and serves a few turns of one user; bench/scale/fill.py
then copies that user's rows to ``--users`` users for the big store. Each start is timed from the process's start
to the first ``200`` of ``GET /healthz`` and to the first answered turn of the user that was awake before the host
stopped (its instance was put to sleep by the clean stop: the turn wakes it). Starts of the two checkouts
alternate, ``--reps`` each, after one start each that is not counted (it writes the bytecode cache, as installing a
package does: the hosts run with one, outside the checkouts).

    .venv/bin/python bench/start/run.py [--users 10000] [--waiting 0] [--reps 5] [--before-src DIR]
                                        [--drivers process,microvm]

Writes bench/results/latest/start.{md,json} (``--report`` names another).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "scale"))
import fill  # noqa: E402
from moorage.client import Client  # noqa: E402
from moorage.devservices.postgres import free_port  # noqa: E402

OUT = ROOT / "bench" / "results" / "latest"
TEMPLATE = "tmpl0000"  # fill.clone's users u0000001… keep its length
AGENT_PY = "async def on_message(ctx, message):\n    return 'echo: ' + message\n"


class Up:
    """``moorage up`` on ``data`` with ``src``; ``health_s`` and ``turn_s``: seconds from its process start."""

    def __init__(self, data: Path, src: Path, driver: str, pycache: Path, images: Path | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if images is not None and not (data / "images").exists():
            data.mkdir(parents=True, exist_ok=True)
            (data / "images").symlink_to(images.resolve())
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update({"MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(self.port), "MOORAGE_SANDBOX_DRIVER": driver,
                    "MOORAGE_LOG_LEVEL": "warning", "PYTHONPATH": str(src), "PYTHONPYCACHEPREFIX": str(pycache)})
        self.log = data.parent / "host.log"
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=env, cwd=data.parent,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.health_s = self._until(lambda: httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200)
        self.key = (data / "local-admin.key").read_text().strip()

    def _until(self, answered: Any) -> float:
        while True:
            try:
                if answered():
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.perf_counter() - self.t0 > 900:
                self.stop()
                raise RuntimeError(f"moorage up did not answer: {self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.01)

    def first_turn(self, agent: str, user: str) -> float:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=600) as c:
            r = c.post(f"/v1/agents/{agent}/invoke", json={"user": user, "message": "back again?"})
            r.raise_for_status()
            self.turn_s = time.perf_counter() - self.t0
        return self.turn_s

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def seed(base: Path, data: Path, src: Path, driver: str, images: Path | None) -> None:
    """An echo agent (users made on first use) and a few turns of the template user."""
    agent = base / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT_PY)
    host = Up(data, src, driver, base / "pycache", images)
    try:
        with Client(host.url, host.key, timeout_s=900) as sdk:
            sdk.deploy("echo", agent)
            for i in range(3):
                sdk.invoke("echo", f"hello {i}, I am {TEMPLATE}", user=TEMPLATE)
    finally:
        host.stop()


def waiting(data: Path, n: int) -> None:
    """``n`` of the copied users each with an async turn waiting for a human answer, announced as such: they stay
    unsettled (a host's start and each webhook round look at them) until someone answers."""
    con = sqlite3.connect(fill.tenant_db(data), isolation_level=None)
    con.execute("BEGIN")
    now = time.time()
    for i in range(1, n + 1):
        user, eid, at = f"u{i:07d}", f"wait{i:08d}", now - i
        con.execute("INSERT INTO executions (id, agent_id, user_id, session, input, events, announced, created_at, "
                    "updated_at, version) VALUES (?, 'echo', ?, 'default', '{}', '[]', 'waiting', ?, ?, 1)",
                    (eid, user, at, at))
        con.execute("INSERT INTO workflow_runs (id, scope, name, status, input, state, current_step, result, error, "
                    "created_at, updated_at, version) VALUES (?, ?, 'turn', 'waiting', '{}', '{}', NULL, NULL, NULL, ?, "
                    "?, 1)", (eid, f"workflow:echo/{user}/{eid}", at, at))
    con.execute("COMMIT")
    con.close()


def measure(data: Path, srcs: dict[str, Path], driver: str, reps: int, pycache: Path,
            images: Path | None) -> dict[str, Any]:
    """Alternating starts of each checkout on ``data``: medians and samples of health and first-turn seconds."""
    samples: dict[str, dict[str, list[float]]] = {k: {"health_s": [], "turn_s": []} for k in srcs}
    for rep in range(reps + 1):
        for label, src in srcs.items():
            host = Up(data, src, driver, pycache / label, images)
            try:
                host.first_turn("echo", TEMPLATE)
            finally:
                host.stop()
            print(f"  [{label}] start {rep}: health {host.health_s:.2f} s, first turn {host.turn_s:.2f} s"
                  + (" (warm-up, not counted)" if rep == 0 else ""), flush=True)
            if rep:
                samples[label]["health_s"].append(host.health_s)
                samples[label]["turn_s"].append(host.turn_s)
    return {label: {**{f"median_{k}": statistics.median(v) for k, v in s.items()}, "samples": s}
            for label, s in samples.items()}


def report(out: dict[str, Any]) -> str:
    labels = list(out["srcs"])
    lines = ["# Start audit: `moorage up` until it answers", "",
             "Written by `bench/start/run.py` (see its docstring). Seconds from the process's start, median of "
             f"{out['args']['reps']} starts of each checkout, alternating, in one run on this machine (2 shared cores: "
             "compare columns, not runs). A host runs with a bytecode cache, as an installed package has.", "",
             "| store | driver | figure | " + " | ".join(f"{k} ({out['srcs'][k]})" for k in labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for name, by_driver in out["stores"].items():
        for driver, res in by_driver.items():
            for fig, what in (("health_s", "until `GET /healthz` answers"),
                              ("turn_s", "until the first turn of a user awake before the stop answers")):
                turns = f", {out['waiting']} turns waiting for a human" if name == "big" and out.get("waiting") else ""
                lines.append(f"| {name} ({out['users'][name]} users{turns}) | {driver} | {what} | "
                             + " | ".join(f"{res[k]['median_' + fig]:.2f}" for k in labels) + " |")
    a = out["args"]
    lines += ["", f"Run: `bench/start/run.py --users {a['users']} --waiting {a.get('waiting', 0)} --reps {a['reps']} "
              f"--drivers {a['drivers']}"
              + (f" --before-src {a['before_src']}`" if a.get("before_src") not in (None, "None") else "`")
              + (f"; {out['fill_s']:.0f} s to copy the users." if "fill_s" in out else "")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--waiting", type=int, default=0,
                    help="async turns of the big store's users left waiting for a human answer (announced waiting)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--report", default="start", help="writes bench/results/latest/<report>.{md,json}")
    ap.add_argument("--before-src", type=Path, help="another checkout's src, measured beside this one")
    ap.add_argument("--drivers", default="process", help="comma-separated: process, microvm (small store only)")
    ap.add_argument("--images", default=os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"),
                    help="a built guest image folder for the micro-VM driver (building one is not a restart's cost)")
    args = ap.parse_args()
    srcs = {"this code": ROOT / "src"}
    if args.before_src:
        srcs = {"before": args.before_src.resolve(), **srcs}
    base = Path(tempfile.mkdtemp(prefix="moorage-start-"))
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                           "srcs": {k: str(v) for k, v in srcs.items()}, "stores": {}, "users": {}}
    oldest = next(iter(srcs.values()))  # the store stays at the schema the older code knows
    try:
        for driver in args.drivers.split(","):
            images = Path(args.images) if driver == "microvm" else None
            work = base / driver
            small = work / "small" / "data"
            small.parent.mkdir(parents=True)
            print(f"[{driver}] seeding {small}", flush=True)
            seed(work / "small", small, oldest, driver, images)
            out["users"]["small"] = 1
            print(f"[{driver}] small store", flush=True)
            out["stores"].setdefault("small", {})[driver] = measure(small, srcs, driver, args.reps, base / "pycache",
                                                                    images)
            if driver != "process":
                continue
            big = work / "big" / "data"
            shutil.copytree(small, big, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
            t0 = time.perf_counter()
            fill.clone(big, TEMPLATE, args.users, log=lambda s: None)
            out["waiting"] = min(args.waiting, args.users)
            waiting(big, out["waiting"])
            out["fill_s"] = time.perf_counter() - t0
            out["users"]["big"] = args.users + 1
            print(f"[{driver}] big store ({args.users} users copied in {out['fill_s']:.0f} s)", flush=True)
            out["stores"].setdefault("big", {})[driver] = measure(big, srcs, driver, args.reps, base / "pycache",
                                                                  images)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.report}.json").write_text(json.dumps(out, indent=1))
    (OUT / f"{args.report}.md").write_text(report(out))
    print(report(out))


if __name__ == "__main__":
    main()
