"""The host side of ``ctx.step`` and ``ctx.interrupt`` for agents in sandboxes: journal, replay, answers.

A step's result is journaled (idempotency key → result) and logged in the run's step log in one
transaction before the guest may return it; a replayed turn gets journaled results back in order.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from moorage.errors import ConflictError, InvalidInput
from moorage.store import TenantStore

if TYPE_CHECKING:
    from moorage.runtime.host_calls import TurnBinding

BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 10.0


class NonDeterministicReplay(InvalidInput):
    """A replayed workflow asked for a different step than the journal recorded at that position."""

    code = "non-deterministic-replay"


def _key(b: "TurnBinding", seq: int, given: str | None) -> str:
    return given if given else f"{b.run_id}:{seq}"


class StepJournal:
    def begin(self, b: "TurnBinding", seq: int, name: str, idempotency_key: str | None) -> dict[str, Any]:
        ts = b.ts
        prior = {s.seq: s for s in ts.runs.steps(b.run_id)}.get(seq)
        if prior is not None and prior.name != name:
            raise NonDeterministicReplay(
                f"step {seq} of run {b.run_id} was {prior.name!r}, the agent now asks for {name!r}",
                hint="workflow code must call its steps in the same order on every replay",
            )
        if prior is not None and prior.status == "succeeded":
            return {"replay": True, "result": prior.result}
        key = _key(b, seq, idempotency_key)
        entry, _ = ts.journal.claim(key, run_id=b.run_id, step=name, scope=b.session_scope)
        if entry.status == "done":  # journaled by an earlier attempt that died before logging the step
            return {"replay": True, "result": entry.result}
        attempts = prior.attempts + 1 if prior is not None else 1
        ts.runs.record_step(b.run_id, seq, name, "running", attempts=attempts,
                            error=prior.error if prior is not None else None)
        return {"replay": False, "idempotency_key": key, "attempt": attempts}

    def _entry(self, ts: TenantStore, b: "TurnBinding", key: str) -> Any:
        entry = ts.journal.get(key)
        # The guest hands the key back; it may only touch entries of the run it is executing.
        if entry is not None and entry.run_id != b.run_id:
            raise InvalidInput("that idempotency key belongs to another workflow")
        return entry

    def complete(self, b: "TurnBinding", seq: int, name: str, key: str, result: Any) -> dict[str, Any]:
        ts = b.ts
        with ts.transaction():
            entry = self._entry(ts, b, key)
            if entry is not None and entry.status == "pending":
                ts.journal.complete(key, expected_version=entry.version, result=result)
            prior = {s.seq: s for s in ts.runs.steps(b.run_id)}.get(seq)
            ts.runs.record_step(b.run_id, seq, name, "succeeded", attempts=prior.attempts if prior else 1, result=result,
                                started_at=prior.started_at if prior else None, finished_at=time.time())
        return {}

    def fail(self, b: "TurnBinding", seq: int, name: str, key: str, error: str, retries: int) -> dict[str, Any]:
        ts = b.ts
        prior = {s.seq: s for s in ts.runs.steps(b.run_id)}.get(seq)
        attempts = prior.attempts if prior else 1
        retry = attempts <= max(0, retries)
        with ts.transaction():
            ts.runs.record_step(b.run_id, seq, name, "retrying" if retry else "failed", attempts=attempts, error=error[:2000])
            # The side effect did not complete: free the claim so the next attempt may take it.
            entry = self._entry(ts, b, key)
            if entry is not None and entry.status == "pending":
                ts.journal.release(key, expected_version=entry.version)
        delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempts - 1)) * random.uniform(0.5, 1.0)
        return {"retry": retry, "backoff_s": delay if retry else 0.0}

    def interrupt(self, b: "TurnBinding", seq: int, payload: Any) -> dict[str, Any]:
        ts = b.ts
        while True:
            run = ts.runs.get(b.run_id)
            interrupts = dict(run.state.get("interrupts", {}))
            rec = interrupts.get(str(seq))
            if rec is not None and rec.get("answered"):
                return {"answered": True, "answer": rec.get("answer")}
            interrupts[str(seq)] = {"payload": payload, "answered": False}
            try:
                ts.runs.update(b.run_id, expected_version=run.version, state={**run.state, "interrupts": interrupts})
                return {"answered": False}
            except ConflictError:
                continue

    def record_answer(self, ts: TenantStore, run_id: str, answer: Any) -> None:
        while True:
            run = ts.runs.get(run_id)
            interrupts = dict(run.state.get("interrupts", {}))
            waiting = sorted((int(k) for k, v in interrupts.items() if not v.get("answered")))
            if not waiting:
                raise ConflictError(f"workflow {run_id} has no question waiting for an answer")
            interrupts[str(waiting[0])] = {**interrupts[str(waiting[0])], "answered": True, "answer": answer}
            try:
                ts.runs.update(run_id, expected_version=run.version, state={**run.state, "interrupts": interrupts})
                return
            except ConflictError:
                continue

    def history(self, b: "TurnBinding") -> list[dict[str, Any]]:
        ts = b.ts
        out = [{"seq": s.seq, "step": s.name, "status": s.status, "attempts": s.attempts, "error": s.error}
               for s in ts.runs.steps(b.run_id)]
        run = ts.runs.get(b.run_id)
        out += [{"correction": c} for c in run.state.get("corrections", [])]
        return out
