"""The operator's ``tenant_max_storage_mib`` (usage/tenant_cap.py): what it costs.

1. On the user's path: two `moorage up` hosts (process driver), one with a ceiling, one without, each serving an
   agent whose turn remembers one 2 kB text; turns alternate between them through the SDK, and each host's turn
   latency is reported (p50, p90).
   ``--control``: the same with neither host capped (what the two hosts differ by without the ceiling).
2. The measure itself: ``tenant_cap.measure`` of a tenant holding N memories of 1 kB with their embeddings, beside
   another tenant of the same size, on SQLite and on a throwaway PostgreSQL cluster.

Run: ``.venv/bin/python bench/usage/tenant_ceiling.py [--turns 100] [--memories 10000 50000]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moorage import Client
from moorage.devservices.fleet import LocalHost
from moorage.devservices.postgres import start_cluster
from moorage.store import Scope, Store
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend
from moorage.usage import tenant_cap

AGENT = '''
async def on_message(ctx, message):
    await ctx.memory.remember(message)
    return "ok"
'''


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def turns(n: int, root: Path, control: bool = False) -> None:
    agent = root / "keeper"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "keeper"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT)
    hosts = {"no ceiling": LocalHost("up", root / "free", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120),
             "ceiling": LocalHost("up", root / "capped", {"MOORAGE_LOG_LEVEL": "warning",
                                                         "MOORAGE_TENANT_MAX_STORAGE_MIB": "0" if control else "1024"},
                                  start_timeout_s=120)}
    try:
        sdks = {k: Client(h.url, h.key) for k, h in hosts.items()}
        for sdk in sdks.values():
            sdk.deploy("keeper", agent)
            for _ in range(5):  # warm: the instance made, the first measure taken
                sdk.invoke("keeper", "w" * 2048, user="ada")
        ms: dict[str, list[float]] = {k: [] for k in sdks}
        for i in range(n):
            for k, sdk in (sdks.items() if i % 2 == 0 else reversed(list(sdks.items()))):
                t = time.perf_counter()
                sdk.invoke("keeper", f"{i} " + "x" * 2048, user="ada")
                ms[k].append((time.perf_counter() - t) * 1000)
        for k, xs in ms.items():
            print(f"turns through moorage up, {k}: p50 {statistics.median(xs):.1f} ms p90 {_pct(xs, 0.9):.1f} ms "
                  f"({len(xs)} turns, one 2 kB memory each)")
        print("  storage under the ceiling:", sdks["ceiling"].usage().get("storage"))
        for sdk in sdks.values():
            sdk.close()
    finally:
        for h in hosts.values():
            h.stop()


def _fill(ts, n: int) -> None:
    for u in range(n // 100):
        scope = Scope.for_user("echo", f"u{u}")
        with ts.transaction():
            for _ in range(100):
                ts.events.append(scope, "note", os.urandom(384).hex() + "a" * 256, embedding=os.urandom(1536))


def measure(store: Store, name: str, n: int) -> None:
    tss = []
    for t in (f"acme{n}", f"globex{n}"):
        _, key = store.operator.create_tenant(t)
        tss.append(store.tenant(store.authenticate(key.secret)))
    for ts in tss:
        _fill(ts, n)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        parts = tenant_cap.measure(tss[0])
        times.append((time.perf_counter() - t) * 1000)
    print(f"measure, {name}: a tenant of {n:,} memories beside another of the same: {parts['store'] / 2**20:.0f} MiB "
          f"counted, p50 {statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--memories", type=int, nargs="*", default=[10_000, 50_000])
    ap.add_argument("--control", action="store_true", help="an A/A run: the second host has no ceiling either")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="moorage-ceiling-"))
    turns(args.turns, root, args.control)
    for n in args.memories:
        s = Store(SQLiteBackend(root / f"store{n}"))
        measure(s, "SQLite", n)
        s.close()
    pg = start_cluster()
    try:
        for n in args.memories:
            s = Store(PostgresBackend(pg.create_database(f"bench{n}")))
            measure(s, "PostgreSQL", n)
            s.close()
    finally:
        pg.stop()


if __name__ == "__main__":
    sys.exit(main())
