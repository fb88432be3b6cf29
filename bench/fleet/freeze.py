"""Fleet benchmark, a host frozen (not killed) with its users awake: how long their next turns wait, measured through
HTTP on another host, against the same fleet running a baseline revision's code in the same run.

A frozen host (stopped, starved, its VM paused) keeps its connections open: its kernel still accepts them. Its users
are asked, each once and all at once, through another host right after the freeze, before its lease lapses, so
that host forwards each turn to the frozen one. This checkout gives up on such a forward once the lease lapsed and
serves the turn itself (``fleet/forward.py``: ``OwnerLapsed``); PostgreSQL ends the frozen host's transaction that
still holds a record's lock (``store/pg_outage.py``). A turn still unanswered after ``--wait-s`` counts as not back.

    .venv/bin/python bench/fleet/freeze.py [--users 6] [--baseline e754905] [--wait-s 90]

Writes bench/results/latest/fleet-freeze.{md,json}; the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from moorage.config import Config
from moorage.fleet.hosts import HostRegistry
from moorage.store import open_store

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "store"))
sys.path.insert(0, str(ROOT / "bench" / "fleet"))
from report import baseline_src  # noqa: E402  (bench/store/report.py: what the areas share)
from run import LEASE_TTL_S, Bench  # noqa: E402  (bench/fleet/run.py: the fleet and its hosts)

OUT = ROOT / "bench" / "results" / "latest"
BASELINE = "e754905"  # the last commit before a forward gave up on a frozen owner


def freeze_once(src: Path, users: int, wait_s: float) -> dict[str, Any]:
    """Three hosts running the code in ``src``; ``users`` awake on h3 (each slept, shipped and woken again), h3
    frozen, and each user's next turn sent through h1 at once: (status or "timeout", seconds) per user."""
    base = Path(tempfile.mkdtemp(prefix="moorage-fleet-freeze-"))
    b = Bench(base, "process")
    b.env["PYTHONPATH"] = str(src)
    frozen = None
    try:
        b.start()
        victims = [f"z{i:02d}" for i in range(users)]
        for u in victims:
            b.ok(2, u)
            b.sleep(2, u)
            b.ok(2, u)  # awake on h3 again
        frozen = b.hosts[2].proc.pid
        os.killpg(frozen, signal.SIGSTOP)
        t0, frozen_at = time.perf_counter(), time.time()

        def ask(u: str) -> tuple[int | str, float]:
            try:
                r = b.api[0].post("/v1/agents/echo/invoke", json={"message": "hi", "user": u}, timeout=wait_s)
                return r.status_code, time.perf_counter() - t0
            except httpx.TimeoutException:
                return "timeout", time.perf_counter() - t0

        with ThreadPoolExecutor(len(victims)) as pool:
            answers = list(pool.map(ask, victims))
        # The part: when h3's lease lapsed (its last heartbeat, written before the freeze, plus the lease), read
        # from the store; each answer's time past that is what the forward's watch and the serving here took.
        lapsed_after_s = _last_beat(b, "h3") + LEASE_TTL_S - frozen_at
        return {"users": users, "answers": [[c, round(s, 2)] for c, s in answers],
                "back": sum(1 for c, _ in answers if c == 200), "lease_lapsed_after_s": round(lapsed_after_s, 2)}
    finally:
        if frozen is not None:
            os.killpg(frozen, signal.SIGCONT)
        b.close()
        shutil.rmtree(base, ignore_errors=True)


def _last_beat(b: Bench, host: str) -> float:
    store = open_store(Config(store_url=b.store_url))
    try:
        return HostRegistry(store.backend).get(host).heartbeat_at
    finally:
        store.close()


def _part(res: dict[str, Any]) -> str:
    """The part-level figure: when the lease lapsed after the freeze, and how long after that the answers came."""
    past = [s - res["lease_lapsed_after_s"] for c, s in res["answers"] if c == 200]
    said = f"lease lapsed {res['lease_lapsed_after_s']:.1f} s after the freeze"
    return said + (f"; answered {statistics.median(past):.2f} s (p50) after it" if past else "")


def _summary(res: dict[str, Any]) -> str:
    back = [s for c, s in res["answers"] if c == 200]
    other = sorted({str(c) for c, _ in res["answers"] if c != 200})
    said = f"{res['back']}/{res['users']} back"
    if back:
        said += f" (p50 {statistics.median(back):.1f} s, all in {max(back):.1f} s)"
    return said + (f"; the rest: {', '.join(other)}" if other else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--wait-s", type=float, default=90.0)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="moorage-freeze-src-"))
    try:
        now = freeze_once(ROOT / "src", args.users, args.wait_s)
        before = freeze_once(baseline_src(args.baseline, scratch), args.users, args.wait_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    headline = (f"host frozen with its users awake (process driver, lease TTL {LEASE_TTL_S:.0f} s), each user's next "
                f"turn through another host: {_summary(now)}; before ({args.baseline}): {_summary(before)} "
                f"within {args.wait_s:.0f} s; part: {_part(now)}")
    res = {"lease_ttl_s": LEASE_TTL_S, "wait_s": args.wait_s, "baseline": args.baseline, "now": now,
           "before": before, "headline": headline, "cpus": os.cpu_count()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fleet-freeze.json").write_text(json.dumps(res, indent=2))
    rows = "\n".join(f"| {name} | {r['back']}/{r['users']} | "
                     f"{', '.join(f'{c} in {s:.1f} s' for c, s in r['answers'])} |"
                     for name, r in (("this checkout", now), (f"before ({args.baseline})", before)))
    (OUT / "fleet-freeze.md").write_text(
        f"# Fleet: a host frozen with its users awake (process driver, lease TTL {LEASE_TTL_S} s)\n\n"
        f"Three `moorage up` hosts on one PostgreSQL and one S3 server; {args.users} users awake on h3, h3 stopped "
        f"(SIGSTOP: its connections stay open), then each user's next turn sent through h1 at once, before h3's "
        f"lease lapsed, so h1 forwards it to h3. A turn unanswered after {args.wait_s:.0f} s counts as not back. "
        f"The baseline is the same fleet running `{args.baseline}`'s code, in the same run.\n\n"
        "| code | back | each turn's answer (status, seconds after the freeze) |\n|---|---|---|\n"
        f"{rows}\n\n"
        f"The part, from the same run: this checkout's {_part(now)} (the baseline's {_part(before)}): the frozen "
        "host's last heartbeat, read from the store, plus the lease; what comes after it is the forwarding host's "
        f"watch (once per heartbeat, 1 s) and serving the turn itself.\n\n{headline}\n")
    print(headline)


if __name__ == "__main__":
    main()
