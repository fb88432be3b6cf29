"""Worker process for the durable crash test: drives a batch of multi-step workflows until killed or done.

Usage: python worker.py STORE_URL TARGET_URL BODY_LOG N_RUNS STEPS   (the API key comes from $MOORAGE_TEST_KEY)
Each step body appends one line to BODY_LOG before doing anything, so the test can count real executions.
Even steps charge a real HTTP target with the step's idempotency key; odd steps compute locally.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import httpx

from moorage.config import Config
from moorage.durable import Backoff, DurableEngine, WorkflowContext
from moorage.store import Scope, open_store

AGENT = "crash-agent"
RETRY = Backoff(base=0.002, factor=2.0, cap=0.02, jitter=0.5)


def run_ids(n: int) -> list[str]:
    return [f"order-{i}" for i in range(n)]


class Worker:
    def __init__(self, target: str, body_log: str, steps: int) -> None:
        self.target = target
        self.steps = steps
        self.fd = os.open(body_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.http = httpx.AsyncClient(timeout=10)
        self.rng = random.Random()

    def _ran(self, run_id: str, i: int) -> None:
        # One write(2) per line with O_APPEND: a SIGKILL cannot leave half a line, and nothing is buffered.
        os.write(self.fd, f"{run_id} {i} {time.time():.6f}\n".encode())

    async def charge(self, run_id: str, i: int, *, idempotency_key: str) -> dict:
        self._ran(run_id, i)
        await asyncio.sleep(self.rng.uniform(0.002, 0.02))
        r = await self.http.post(f"{self.target}/charge", json={"amount": i + 1},
                                 headers={"Idempotency-Key": idempotency_key})
        r.raise_for_status()  # a 503 from the target is retried by the engine
        # Work after the side effect (parsing, bookkeeping): a kill here leaves an applied, unjournaled charge.
        await asyncio.sleep(self.rng.uniform(0.005, 0.03))
        return {"receipt": r.json()["receipt"], "key": idempotency_key}

    async def compute(self, run_id: str, i: int) -> int:
        self._ran(run_id, i)
        await asyncio.sleep(self.rng.uniform(0.005, 0.04))
        return i * i

    async def order(self, ctx: WorkflowContext, inp: dict) -> dict:
        receipts = []
        squares = 0
        for i in range(self.steps):
            if i % 2 == 0:
                out = await ctx.step(f"charge-{i}", self.charge, ctx.run_id, i, retries=8, backoff=RETRY)
                receipts.append(out["receipt"])
            else:
                squares += await ctx.step(f"compute-{i}", self.compute, ctx.run_id, i)
            ctx.state["done"] = i + 1
            ctx.state["squares"] = squares
        return {"receipts": receipts, "squares": squares}


async def main(url: str, target: str, body_log: str, n_runs: int, steps: int) -> None:
    store = open_store(Config(store_url=url))
    ts = store.tenant(store.authenticate(os.environ["MOORAGE_TEST_KEY"]))
    w = Worker(target, body_log, steps)
    engine = DurableEngine(ts, {"order": w.order})
    print("ready", flush=True)
    await engine.recover()
    for rid in run_ids(n_runs):
        await engine.start(Scope.workflow(AGENT, rid, "u1"), "order", input={"n": steps})
    await w.http.aclose()
    store.close()
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
