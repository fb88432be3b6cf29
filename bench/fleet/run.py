"""Fleet benchmark: three `moorage up` hosts on one PostgreSQL and one S3 server (SeaweedFS), measured through HTTP.

* local wake: a turn to a sleeping user through the host that put it to sleep (its own disk is the newest copy);
* cross-host wake: the same, through another host, which claims the instance and fetches its shipped snapshot;
* cold-host first wake: a sleeping user's turn through a host that just started (nothing of it on that disk), with
  the agent's template fetched at that wake, and through a host that fetched it ahead (fleet/prefetch.py);
* host kill: users awake on one host, the host and its sandboxes SIGKILLed, then every one of them asked through a
  survivor until it answers; acknowledged turns (those that had replied) counted in the store before and after;
* snapshot to S3: the time each sleep took to ship (recorded by the host in the instance's record).

    .venv/bin/python bench/fleet/run.py [--users 20] [--kill-users 9] [--driver process] [--quick]

Writes bench/results/latest/fleet-<driver>.{md,json}; the last line printed is the headline. The micro-VM run
(``--driver microvm``) shares the guest image directory named by MOORAGE_TEST_IMAGES_DIR when set.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost, fleet_env, write_counter_agent
from moorage.devservices.postgres import start_cluster
from moorage.devservices.seaweedfs import start_seaweedfs
from moorage.store import open_store

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "store"))
from report import latency_summary  # noqa: E402  (bench/store/report.py: what the areas share)

OUT = ROOT / "bench" / "results" / "latest"
LEASE_TTL_S = 4.0
class Bench:
    def __init__(self, base: Path, driver: str) -> None:
        self.base, self.driver = base, driver
        self.pg = start_cluster()
        self.store_url = self.pg.create_database("fleetbench")
        self.s3 = start_seaweedfs()
        self.s3.create_bucket("fleetbench")
        self.env = fleet_env(self.store_url, self.s3.settings("fleetbench", "bench"), lease_ttl_s=str(LEASE_TTL_S),
                             heartbeat_s="1", log_level="warning")
        self.hosts: list[LocalHost] = []
        self.api: list[Any] = []

    def add_host(self, **settings: str) -> int:
        env = {**self.env, **{f"MOORAGE_{k.upper()}": v for k, v in settings.items()}}
        h = LocalHost(f"h{len(self.hosts) + 1}", self.base / f"h{len(self.hosts) + 1}", env, driver=self.driver)
        self.hosts.append(h)
        self.api.append(h.client(self.hosts[0].key))
        return len(self.hosts) - 1

    def start(self, hosts: int = 3) -> None:
        """Start ``hosts`` hosts and deploy the counter agent (``echo``) through the first."""
        for _ in range(hosts):
            self.add_host()
        r = self.api[0].post("/v1/agents/echo/deployments", content=tar_dir(write_counter_agent(self.base)),
                             headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    def turn(self, i: int, user: str) -> tuple[int, float]:
        t = time.perf_counter()
        r = self.api[i].post("/v1/agents/echo/invoke", json={"message": "hi", "user": user})
        return r.status_code, (time.perf_counter() - t) * 1000

    def ok(self, i: int, user: str) -> float:
        code, ms = self.turn(i, user)
        assert code == 200, (code, user)
        return ms

    def records(self) -> dict[str, Any]:
        with open_store(Config(store_url=self.store_url)) as store:
            return {r.scope.user: r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=100000)}

    def succeeded(self, users: list[str]) -> int:
        with open_store(Config(store_url=self.store_url)) as store:
            ts = next(store.operator.tenants())
            return sum(1 for r in ts.runs.list(limit=100000) if r.scope.user in users and r.status == "succeeded")

    def wake_spans(self, host: str) -> dict[str, list[float]]:
        """Per instance, the durations (ms) of its wakes on ``host`` as the host traced them (claim to running)."""
        out: dict[str, list[float]] = {}
        with open_store(Config(store_url=self.store_url)) as store:
            for ts in store.operator.tenants():
                for s in ts.spans.recent(limit=100000):
                    if s.name == "lifecycle.woke" and s.attrs.get("host") == host and s.end_ts:
                        out.setdefault(s.attrs["instance"], []).append((s.end_ts - s.start_ts) * 1000)
        return out

    def live_deployment(self) -> str:
        with open_store(Config(store_url=self.store_url)) as store:
            return next(store.operator.tenants()).agents.get("echo").live_deployment

    def sleep(self, i: int, user: str) -> None:
        sid = self.records()[user].id
        r = self.api[i].post(f"/v1/sandboxes/{sid}/sleep")
        assert r.status_code == 200 and r.json()["slept"], r.text

    def close(self) -> None:
        for c in self.api:
            c.close()
        for h in self.hosts:
            h.stop()
        self.s3.stop()
        self.pg.stop()


def _ms(xs_ms: list[float]) -> dict[str, Any]:
    """The shared latency summary (it takes seconds) under short keys: n, p50, p99, min, max in ms."""
    return {k.removesuffix("_ms"): v for k, v in latency_summary([x / 1000 for x in xs_ms]).items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="moorage-fleet-bench-"))
    b = Bench(base, args.driver)
    try:
        b.start()
        users = [f"u{i:03d}" for i in range(args.users)]
        for u in users:
            b.ok(0, u)
            b.sleep(0, u)
        local = [b.ok(0, u) for u in users]  # woken where it slept: its own disk
        for u in users:
            b.sleep(0, u)
        cross = [b.ok(1, u) for u in users]  # woken on h2 from the object store
        recs = b.records()
        ships = [float(recs[u].meta["shipped"]["ms"]) for u in users]
        fetches = [float(recs[u].meta["resumed_from"]["fetch_ms"]) for u in users]
        ids = {recs[u].id for u in users}
        local_in = [ms for sid, xs in b.wake_spans("h1").items() if sid in ids for ms in xs[-1:]]
        cross_in = [ms for sid, xs in b.wake_spans("h2").items() if sid in ids for ms in xs[-1:]]
        for u in users:
            b.sleep(1, u)
        # A host that just started, with nothing of this user or agent on its disk; it fetches the template at the
        # first wake (templates are not fetched ahead here: the figure before fleet/prefetch.py).
        fresh = b.add_host(template_prefetch="0")
        cold_ms = b.ok(fresh, users[0])
        # A host that joined a little earlier: it fetched the live deployment's template ahead (at its start).
        ahead = b.add_host(log_level="info")
        t = time.perf_counter()
        dep = b.live_deployment()
        while not (b.hosts[ahead].data / "templates" / f"{dep}.json").exists():
            assert time.perf_counter() - t < 300, "the template was not fetched ahead within 300 s"
            time.sleep(0.05)
        ahead_fetch_s = time.perf_counter() - t
        time.sleep(1.0)  # (the fetch's last writes, and the RAM sealed ahead, settle; nothing else runs there)
        before = len(b.hosts[ahead].log.read_bytes())
        ahead_ms = b.ok(ahead, users[1])
        # The template RAM's sealed in-memory copy (micro-VM forks map it), from the host's own log: made ahead
        # with the fetch (fleet/prefetch.py), or by the first launch in the process (the wake just measured).
        text = b.hosts[ahead].log.read_bytes()

        def sealed_in(part: bytes) -> list[float]:
            return [float(m) for m in re.findall(rb"template RAM sealed in memory .*?\bms=([0-9.]+)", part)]

        victims = [f"k{i:02d}" for i in range(args.kill_users)]
        for u in victims:
            b.ok(2, u)
            b.sleep(2, u)
            b.ok(2, u)  # awake again on h3; this turn is acknowledged but not shipped
        acked = b.succeeded(victims)
        b.hosts[2].kill()
        killed = time.perf_counter()

        def back(u: str) -> float:
            while True:
                code, _ = b.turn(0, u)
                if code == 200:
                    return time.perf_counter() - killed
                time.sleep(0.1)

        with ThreadPoolExecutor(len(victims)) as pool:
            times = list(pool.map(back, victims))
        after = b.succeeded(victims)
        lost = max(0, acked - (after - len(victims)))  # each victim added exactly one turn since
        return {
            "hosts": 3, "driver": args.driver, "users": args.users, "lease_ttl_s": LEASE_TTL_S,
            "local_wake_ms": _ms(local), "cross_host_wake_ms": _ms(cross),
            "cold_host_first_wake_ms": round(cold_ms, 1), "prefetched_first_wake_ms": round(ahead_ms, 1),
            "prefetch_done_after_healthy_s": round(ahead_fetch_s, 2), "sealed_ram_ahead_ms": sealed_in(text[:before]), "first_wake_sealed_ram_ms": sealed_in(text[before:]), "ship_ms": _ms(ships), "fetch_ms": _ms(fetches),
            "local_wake_in_host_ms": _ms(local_in), "cross_wake_in_host_ms": _ms(cross_in),
            "kill": {"users": len(victims), "back": len(times), "all_back_s": round(max(times), 2),
                     "acknowledged_before": acked, "acknowledged_lost": lost},
        }
    finally:
        b.close()
        shutil.rmtree(base, ignore_errors=True)


def _listed_ms(xs: list[float]) -> str:
    return ", ".join(f"{x:.0f} ms" for x in xs) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--kill-users", type=int, default=9)
    ap.add_argument("--driver", default="process", choices=("process", "microvm"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.users, args.kill_users = 5, 3
    res = run(args)
    res["machine"] = {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}
    k = res["kill"]
    headline = (f"fleet hosts {res['hosts']}; cross-host wake p50 {res['cross_host_wake_ms']['p50']:.0f} ms "
                f"(local {res['local_wake_ms']['p50']:.0f} ms); cold-host first wake {res['cold_host_first_wake_ms']:.0f} ms "
                f"(template fetched ahead: {res['prefetched_first_wake_ms']:.0f} ms); "
                f"host kill: users back {k['back']}/{k['users']} in {k['all_back_s']:.1f} s, acknowledged turns lost "
                f"{k['acknowledged_lost']}; snapshot to S3 p50 {res['ship_ms']['p50']:.0f} ms")
    res["headline"] = headline
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"fleet-{res['driver']}.json").write_text(json.dumps(res, indent=2))
    (OUT / f"fleet-{res['driver']}.md").write_text(
        f"# Fleet ({res['driver']} driver, lease TTL {LEASE_TTL_S} s, {res['users']} users)\n\n"
        "| what | p50 ms | p99 ms |\n|---|---|---|\n"
        f"| local wake (turn through the host that slept it) | {res['local_wake_ms']['p50']:.1f} | {res['local_wake_ms']['p99']:.1f} |\n"
        f"| cross-host wake (another host, snapshot fetched) | {res['cross_host_wake_ms']['p50']:.1f} | {res['cross_host_wake_ms']['p99']:.1f} |\n"
        f"| snapshot shipped to S3 at sleep | {res['ship_ms']['p50']:.1f} | {res['ship_ms']['p99']:.1f} |\n"
        f"| snapshot fetched by the waking host (part of cross-host wake) | {res['fetch_ms']['p50']:.1f} | "
        f"{res['fetch_ms']['p99']:.1f} |\n"
        f"| wake inside the host, local (claim to running, its trace span) | {res['local_wake_in_host_ms']['p50']:.1f} | "
        f"{res['local_wake_in_host_ms']['p99']:.1f} |\n"
        f"| wake inside the host, cross-host (fetch included) | {res['cross_wake_in_host_ms']['p50']:.1f} | "
        f"{res['cross_wake_in_host_ms']['p99']:.1f} |\n\n"
        "What bounds cross-host wake over local: the fetch above (manifest, then the chunks the host lacks, in "
        "parallel) plus claiming the record under a new epoch; the rest of the wake is the same as local.\n\n"
        f"Cold-host first wake: {res['cold_host_first_wake_ms']:.1f} ms on a host that just started and fetches the "
        f"agent's template at that wake (`template_prefetch = 0`); {res['prefetched_first_wake_ms']:.1f} ms on one "
        f"that fetched it ahead (`fleet/prefetch.py`: done {res['prefetch_done_after_healthy_s']:.1f} s after the host "
        f"answered its health check; the template RAM sealed in memory ahead: "
        f"{_listed_ms(res['sealed_ram_ahead_ms'])}, by that first wake: {_listed_ms(res['first_wake_sealed_ram_ms'])})."
        f" Both fetch the user's "
        f"snapshot, like a cross-host wake. Host kill: {k['back']}/{k['users']} users back "
        f"in {k['all_back_s']} s (lease TTL {LEASE_TTL_S} s); acknowledged turns lost: {k['acknowledged_lost']} "
        f"of {k['acknowledged_before']}.\n\n{headline}\n")
    print(headline)


if __name__ == "__main__":
    main()
