"""Compare-and-set under contention: N processes x M increments of one key through ``ts.state.put(expected_version=...)``.

Each worker re-reads and retries on ``ConflictError``; lost updates = N*M - final value (must be 0).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

from moorage.errors import ConflictError
from moorage.store import Scope, Store
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend

SCOPE = Scope.for_user("bench", "counter-owner")
KEY = "counter"


def _open(kind: str, where: str) -> Store:
    return Store(SQLiteBackend(where) if kind == "sqlite" else PostgresBackend(where, pool_size=2))


def _worker(kind: str, where: str, secret: str, increments: int, start: "mp.synchronize.Event", out: "mp.Queue") -> None:
    store = _open(kind, where)
    ts = store.tenant(store.authenticate(secret))
    retries = 0
    start.wait()
    for _ in range(increments):
        while True:
            rec = ts.state.get(SCOPE, KEY)
            try:
                ts.state.put(SCOPE, KEY, {"n": rec.value["n"] + 1}, expected_version=rec.version)
                break
            except ConflictError:
                retries += 1
    out.put(retries)
    store.close()


@dataclass
class CasResult:
    backend: str
    processes: int
    increments: int
    final: int
    lost_updates: int
    retries: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.processes * self.increments / self.seconds


def run_cas(kind: str, where: str, secret: str, processes: int, increments: int) -> CasResult:
    store = _open(kind, where)
    ts = store.tenant(store.authenticate(secret))
    ts.state.put(SCOPE, KEY, {"n": 0}, expected_version=0)
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kind, where, secret, increments, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # let every worker open its store before the clock starts
    t0 = time.perf_counter()
    start.set()
    retries = sum(out.get(timeout=600) for _ in procs)
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"CAS worker exited with {p.exitcode}")
    final = ts.state.get(SCOPE, KEY).value["n"]
    store.close()
    return CasResult(kind, processes, increments, final, processes * increments - final, retries, seconds)
