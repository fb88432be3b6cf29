"""Online backup benchmark: how long `moorage backup DEST` takes on a running `moorage up` with N users, and what it
does to the turns of neighbours sending turns back to back meanwhile (p99 in the window before vs during).

Real `moorage up` (process driver unless --driver), real HTTP turns. Writes bench/results/latest/online_backup.{md,json};
the last line printed is the headline.

    .venv/bin/python bench/lifecycle/online_backup.py [--users 20 50 100] [--neighbours 5] [--driver process]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from moorage import __version__
from moorage.client.sync import Client
from moorage.devservices.counter_agent import write_counter_agent
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 if xs else float("nan")


def one(tmp: Path, users: int, neighbours: int, driver: str, window_s: float) -> dict[str, Any]:
    agent = write_counter_agent(tmp)
    data = tmp / "data"
    host = LocalHost("bench", data, {"MOORAGE_LOG_LEVEL": "warning"}, driver=driver, start_timeout_s=600)
    lat: list[tuple[float, float]] = []
    errors: list[str] = []
    stop = threading.Event()

    def neighbour(user: str) -> None:
        with httpx.Client(base_url=host.url, headers={"Authorization": f"Bearer {host.key}"}, timeout=120) as http:
            while not stop.is_set():
                t0 = time.time()
                r = http.post("/v1/agents/counter/invoke", json={"user": user, "message": "go"})
                (lat.append((t0, time.time() - t0)) if r.status_code == 200 else errors.append(r.text[:200]))

    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent)
            for i in range(users):
                sdk.invoke("counter", "hello", user=f"u{i}")
        threads = [threading.Thread(target=neighbour, args=(f"u{i}",)) for i in range(neighbours)]
        for t in threads:
            t.start()
        time.sleep(3)
        t_before = time.time()
        time.sleep(window_s)
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "backup", str(tmp / "backup")],
                           env={**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_SANDBOX_DRIVER": driver},
                           capture_output=True, text=True, timeout=3600, cwd=ROOT)
        t1 = time.time()
        stop.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        stop.set()
        host.stop()
    if r.returncode != 0:
        raise SystemExit(f"backup failed: {r.stderr}")
    manifest = json.loads((tmp / "backup" / "moorage-backup.json").read_text())
    before = [s for a, s in lat if t_before <= a < t0]
    during = [s for a, s in lat if t0 <= a < t1]
    return {"users": users, "neighbours": neighbours, "driver": driver,
            "backup_s": round(manifest["finished_at"] - manifest["started_at"], 2), "cli_s": round(t1 - t0, 2),
            "p99_before_ms": round(p99(before), 1), "p99_during_ms": round(p99(during), 1),
            "turns_before": len(before), "turns_during": len(during), "errors": len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, nargs="+", default=[20, 50, 100])
    ap.add_argument("--neighbours", type=int, default=5)
    ap.add_argument("--driver", default="process")
    ap.add_argument("--window", type=float, default=8.0, help="seconds of neighbours' turns measured before")
    args = ap.parse_args()
    rows = []
    for n in args.users:
        with tempfile.TemporaryDirectory(prefix="bench-backup-") as tmp:
            rows.append(one(Path(tmp), n, args.neighbours, args.driver, args.window))
            print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "bench" / "results" / "latest"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"moorage": __version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg()[0]}
    (out / "online_backup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Online backup (`moorage backup` on a running `moorage up`)", "",
             f"moorage {__version__}, {os.cpu_count()} CPUs, load average {meta['load_avg']:.1f} at the end.", "",
             "| users | neighbours | driver | backup s | neighbours' p99 before ms | during ms | turns during | errors |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['users']} | {r['neighbours']} | {r['driver']} | {r['backup_s']} | {r['p99_before_ms']} | "
              f"{r['p99_during_ms']} | {r['turns_during']} | {r['errors']} |" for r in rows]
    (out / "online_backup.md").write_text("\n".join(lines) + "\n")
    last = rows[-1]
    print(f"online backup of {last['users']} users: {last['backup_s']} s; neighbours' p99 {last['p99_before_ms']} ms "
          f"before, {last['p99_during_ms']} ms during; {last['errors']} failed turns")


if __name__ == "__main__":
    main()
