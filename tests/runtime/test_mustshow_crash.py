"""SIGKILL of a `moorage up` host mid-workflow, many times at random points, with a real payments target.

A real server process (process sandboxes, SQLite, its own data dir) runs an agent whose turn is a
six-step workflow; three steps pay through ``ctx.fetch`` with the step's idempotency key to a real
HTTP target that applies each key once. The test kills the host with SIGKILL at random moments while
turns are mid-way, restarts it each time (recovery resumes the interrupted turns) and asserts: every
run succeeded, no step ran again after its result was journaled, every side effect landed once.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.durable import DurableEngine
from moorage.store import open_store
from tests.lifecycle.crash_up import Up, stop_sandboxes
from tests.runtime.conftest import write_agent

STEPS = ["prepare", "charge", "reserve", "ship", "audit", "notify"]
PAYING = {"charge", "ship", "notify"}
USERS = [f"u{i}" for i in range(5)]
TURNS_PER_USER = 2
MIN_KILLS = 8

AGENT = '''
import asyncio, json, os, time, uuid

LOG = "/work/exec.log"
STEPS = %(steps)r
PAYING = %(paying)r


def note(turn, seq, name, token):
    # One line per execution of a step body, on the sandbox's disk, before its side effect.
    with open(LOG, "a") as f:
        f.write(json.dumps({"turn": turn, "seq": seq, "step": name, "token": token, "t": time.time()}) + "\\n")
        f.flush()
        os.fsync(f.fileno())


async def on_message(ctx, message):
    _, order, url = message.split()
    out = []
    for seq, name in enumerate(STEPS):
        async def body(idempotency_key, seq=seq, name=name):
            token = uuid.uuid4().hex
            note(ctx.turn_id, seq, name, token)
            await asyncio.sleep(0.15)
            if name in PAYING:
                r = await ctx.fetch(url, method="POST", json={"order": order, "step": name},
                                    idempotency_key=idempotency_key)
                if r["status"] != 200:
                    raise RuntimeError("payments answered %%s" %% r["status"])
                return {"token": token, "effect": json.loads(r["body"])["effect"]}
            return {"token": token}
        out.append(await ctx.step(name, body))
    return "done %%s %%s" %% (order, ",".join(str(o.get("effect", "-")) for o in out))
'''


class _Payments(BaseHTTPRequestHandler):
    lock = threading.Lock()
    applied: dict[str, dict[str, Any]] = {}  # idempotency key -> the effect it applied
    seen: dict[str, int] = {}  # idempotency key -> requests carrying it

    def do_POST(self) -> None:  # noqa: N802
        key = self.headers.get("Idempotency-Key", "")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + 1
            if key and key not in self.applied:
                self.applied[key] = {"effect": len(self.applied) + 1, "order": body["order"], "step": body["step"]}
            effect = self.applied[key]["effect"] if key else -1
        data = json.dumps({"effect": effect}).encode()
        self.send_response(200 if key else 400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def payments() -> Iterator[str]:
    _Payments.applied, _Payments.seen = {}, {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Payments)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/pay"
    srv.shutdown()


def exec_lines(data: Path) -> list[dict[str, Any]]:
    lines = []
    for log in (data / "sandboxes").glob("*/layer/work/exec.log"):
        lines += [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return lines


@pytest.mark.timeout(240)
def test_sigkill_mid_workflow_many_times(tmp_path: Path, payments: str) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    seed_note = f"rng state {rng.getstate()[1][:2]}"
    agent = write_agent(tmp_path / "pipeline", "pipeline", AGENT % {"steps": STEPS, "paying": sorted(PAYING)},
                        '[agent.egress]\nallow = ["http://127.0.0.1:"]\n')
    data = tmp_path / "data"
    # The payment service is a loopback server: the operator policy of this test allows it.
    server = Up(data, free_port(), MOORAGE_EGRESS_ALLOW_CIDRS="127.0.0.0/8", MOORAGE_LOG_LEVEL="warning")
    try:
        server.start()
        headers = {"Authorization": f"Bearer {server.key}"}
        r = httpx.post(f"{server.url}/v1/agents/pipeline/deployments", content=tar_dir(agent),
                       headers={**headers, "Content-Type": "application/gzip"}, timeout=300)
        assert r.status_code in (200, 201), r.text

        # Clients: each user sends its turns in order with an Idempotency-Key and retries the same key
        # until it gets the reply (connection refused or reset while the host is dead or recovering).
        replies: dict[str, str] = {}
        errors: list[str] = []
        deadline = time.monotonic() + 150

        def client(user: str) -> None:
            with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
                for n in range(TURNS_PER_USER):
                    order = f"{user}-o{n}"
                    while time.monotonic() < deadline:
                        try:
                            resp = c.post("/v1/agents/pipeline/invoke",
                                          json={"user": user, "session": "s", "message": f"pay {order} {payments}"},
                                          headers={"Idempotency-Key": order})
                        except httpx.HTTPError:
                            time.sleep(0.2)
                            continue
                        if resp.status_code == 200:
                            replies[order] = resp.json()["reply"]
                            break
                        if resp.status_code not in (409, 429, 502, 503):
                            errors.append(f"{order}: {resp.status_code} {resp.text[:300]}")
                        time.sleep(0.2)

        threads = [threading.Thread(target=client, args=(u,), daemon=True) for u in USERS]
        for t in threads:
            t.start()

        # The killer: after a random number of new step executions (so the host is mid-workflow), wait a
        # random fraction of a step and SIGKILL the host; start it again at once (recovery runs on start).
        kills = 0
        total = len(USERS) * TURNS_PER_USER * len(STEPS)
        while kills < MIN_KILLS:
            before = len(exec_lines(data))
            want = before + rng.randint(1, 4)
            round_deadline = time.monotonic() + 60
            while (len(exec_lines(data)) < want and time.monotonic() < round_deadline
                   and len(replies) < len(USERS) * TURNS_PER_USER):
                assert server.proc is not None and server.proc.poll() is None, server.log.read_text()[-3000:]
                time.sleep(0.02)
            assert len(exec_lines(data)) < total * 3, "the workflows keep re-running"
            if len(replies) == len(USERS) * TURNS_PER_USER:
                break  # everything finished before enough kills: the assertion below reports it
            time.sleep(rng.uniform(0.0, 0.3))
            server.kill()
            kills += 1
            server.start(wait=False)  # the next kill may come while it recovers
        assert kills >= MIN_KILLS, f"only {kills} kills before every workflow finished ({seed_note})"

        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not errors, errors
        assert len(replies) == len(USERS) * TURNS_PER_USER, (sorted(replies), server.log.read_text()[-3000:])
    finally:
        server.stop()
        stop_sandboxes(data)

    # -- what the store says ---------------------------------------------------------------------------
    store = open_store(Config(data_dir=data, sandbox_driver="process"))
    try:
        (ts,) = list(store.operator.tenants())
        runs = [r for r in ts.runs.list(limit=1000) if r.name == "turn"]
        assert len(runs) == len(USERS) * TURNS_PER_USER
        assert {r.status for r in runs} == {"succeeded"}, [(r.id, r.status, r.error) for r in runs]
        journal = {r.id: [h for h in DurableEngine(ts).history(r.id) if h.kind == "step" and h.status == "succeeded"]
                   for r in runs}
    finally:
        store.close()

    # -- the execution log against the journal: nothing ran again once journaled ---------------------------
    lines = exec_lines(data)
    for run_id, steps in journal.items():
        assert [h.name for h in steps] == STEPS, (run_id, [h.name for h in steps])
        for pos, h in enumerate(steps):
            runs_of_step = [x for x in lines if x["turn"] == run_id and x["seq"] == pos]
            # The journaled result came from one real execution of the body...
            assert h.result["token"] in {x["token"] for x in runs_of_step}, (run_id, pos)
            # ...and no execution of this step started after its result was journaled.
            assert h.finished_at is not None
            late = [x for x in runs_of_step if x["t"] > h.finished_at]
            assert not late, (run_id, h.name, late, h.finished_at)

    # -- the payments target: each side effect landed exactly once ---------------------------------------
    effects = [(a["order"], a["step"]) for a in _Payments.applied.values()]
    expected = {(f"{u}-o{n}", s) for u in USERS for n in range(TURNS_PER_USER) for s in PAYING}
    assert sorted(effects) == sorted(expected), "a payment was applied twice or not at all"
    # The reply of each turn names the effects the target applied for its order.
    for order, reply in replies.items():
        mine = {a["step"]: a["effect"] for a in _Payments.applied.values() if a["order"] == order}
        got = reply.split()[2].split(",")
        assert [got[i] for i, s in enumerate(STEPS) if s in PAYING] == [str(mine[s]) for s in STEPS if s in PAYING]
    # Requests were retried across kills (that is what the idempotency keys are for); report it.
    print(f"kills={kills} executions={len(lines)} (minimum {total}) "
          f"payment requests={sum(_Payments.seen.values())} applied={len(_Payments.applied)}")
