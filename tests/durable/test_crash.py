"""The must-show durability test: SIGKILL the host process at random points of multi-step workflows.

After many kills every workflow finishes; no step body starts after its result was journaled; every charge
lands exactly once at a real HTTP target that honours idempotency keys, and the journal agrees with it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from moorage.durable import DurableEngine
from tests.durable.conftest import Host
from tests.durable.target import ChargeTarget
from tests.durable.worker import run_ids

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]
RUNS, STEPS, KILLS = 6, 16, 15


def _spawn(host: Host, target: ChargeTarget, body_log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "MOORAGE_TEST_KEY": host.key, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(WORKER), host.url, target.url, str(body_log), str(RUNS), str(STEPS)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _resent_after_apply(target: ChargeTarget) -> bool:
    """Did the target see a key again after applying it (a host killed after the charge, before its journal)?"""
    return any(n > 1 for k, n in list(target.seen.items()) if k not in target.rejected_keys)


def _kill_in_the_window(host: Host, target: ChargeTarget, body_log: Path) -> None:
    """Kill a host right after the target applied one of its charges, before the response is back: the host
    never journaled that charge, so its successor sends the key again (the case idempotency keys exist for;
    random kill points can miss that window, and did in CI)."""
    p = _spawn(host, target, body_log)
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    fired = threading.Event()

    def kill(key: str) -> None:
        if key not in target.rejected_keys and not fired.is_set():  # a 503'd key is resent anyway
            os.kill(p.pid, signal.SIGKILL)
            fired.set()

    target.on_applied = kill
    try:
        p.wait(timeout=60)
    finally:
        target.on_applied = None
    assert fired.is_set(), f"the host exited ({p.returncode}) before the target applied a charge"


def test_sigkill_at_random_points_every_workflow_finishes_exactly_once(host: Host, tmp_path: Path) -> None:
    body_log = tmp_path / "bodies.log"
    rng = random.Random(20240607)
    with ChargeTarget(flaky=0.25) as target:
        # First one kill between an applied charge and its journal entry (the first host has every charge
        # still to do), then KILLS at random points.
        _kill_in_the_window(host, target, body_log)
        kills = 1
        while kills <= KILLS:
            p = _spawn(host, target, body_log)
            assert p.stdout is not None and p.stderr is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rng.uniform(0.03, 0.3))
            if p.poll() is not None:
                break  # it finished everything before we could kill it
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            kills += 1
        # The last host runs undisturbed to the end.
        p = _spawn(host, target, body_log)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.split()[-1] == "done"

        assert kills > KILLS, f"the work finished after {kills - 1} random kills; make it longer"
        ts = host.restart()
        lines: dict[tuple[str, int], list[float]] = defaultdict(list)
        for line in body_log.read_text().splitlines():
            rid, i, at = line.split()
            lines[(rid, int(i))].append(float(at))

        journaled_keys: dict[str, int] = {}
        crash_reruns = logged_retries = 0
        for rid in run_ids(RUNS):
            run = ts.runs.get(rid)
            assert run.status == "succeeded", (rid, run.status, run.error)
            rows = ts.runs.steps(rid)
            steps = [s for s in rows if s.status == "succeeded"]
            logged_retries += sum(1 for s in rows if s.status == "retry")
            assert [s.name for s in steps] == [f"{'charge' if i % 2 == 0 else 'compute'}-{i}" for i in range(STEPS)]
            for i, s in enumerate(steps):
                runs_of_body = lines[(rid, i)]
                assert runs_of_body, f"{rid} step {i} is journaled but its body never ran"
                # Every execution of the body started before its result was journaled: none after.
                assert max(runs_of_body) <= s.finished_at, f"{rid} step {i} ran again after it was journaled"
                # Executions beyond the logged attempts are the ones a SIGKILL cut short before the journal write.
                crash_reruns += len(runs_of_body) - s.attempts
                if i % 2 == 0:
                    journaled_keys[s.result["key"]] = s.result["receipt"]
            assert run.result == {
                "receipts": [journaled_keys[steps[i].result["key"]] for i in range(0, STEPS, 2)],
                "squares": sum(i * i for i in range(1, STEPS, 2)),
            }
            assert run.state == {"done": STEPS, "squares": sum(i * i for i in range(1, STEPS, 2))}

        # Exactly once at the target: one applied charge per charge step, and the journal holds its receipt.
        charges = RUNS * len(range(0, STEPS, 2))
        assert len(target.applied) == charges == len(journaled_keys)
        assert {k: v["receipt"] for k, v in target.applied.items()} == journaled_keys
        assert target.balance == RUNS * sum(i + 1 for i in range(0, STEPS, 2))
        # The kills really landed inside step bodies (bodies re-ran, keys re-sent after an applied charge)...
        assert crash_reruns > 0
        assert _resent_after_apply(target)
        # ...and the engine's retries got past the target's 503s, each failed attempt in the step log.
        assert target.rejected_keys and logged_retries > 0
        history = DurableEngine(ts).history(run_ids(RUNS)[0])
        assert all(h.position is not None or h.kind == "attempt" for h in history)
