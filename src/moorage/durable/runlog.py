"""One workflow run's step log, read once and then extended strictly in order: the engine's primitives.

The in-process ``WorkflowContext`` and the host side of the guest channel both drive a run through a
``RunLog``. Every change commits one transaction that also compare-and-sets the run's version, so at most
one executor can extend a run's log, and a step's result is on disk before anyone is told it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from moorage.durable.errors import NonDeterminismError, RunNotWaiting, RunTakenOver
from moorage.errors import ConflictError, InvalidInput
from moorage.store import Scope, Step, TenantStore, WorkflowRun
from moorage.store.model import check_id

T = TypeVar("T")

# Row statuses in the ``steps`` table. Positional rows take the next position of the workflow (the order in
# which its code calls step/interrupt/correct); the others annotate the position that follows them.
STEP_OK = "succeeded"  # positional: a step's journaled result
STEP_FAILED = "failed"  # positional: a step that failed on its last allowed attempt
ATTEMPT_FAILED = "retry"  # one failed attempt of the next positional step (it was or will be retried)
WAITING = "waiting"  # positional: an interrupt nobody has answered yet
ANSWERED = "answered"  # positional: an answered interrupt
CORRECTION = "correction"  # positional: a correction recorded by the workflow (ctx.correct)
NOTE = "note"  # a correction sent from outside while the run was not running (engine.correct)

POSITIONAL = frozenset({STEP_OK, STEP_FAILED, WAITING, ANSWERED, CORRECTION})
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
_KIND = {STEP_OK: "step", STEP_FAILED: "step", ATTEMPT_FAILED: "attempt", WAITING: "interrupt",
         ANSWERED: "interrupt", CORRECTION: "correction", NOTE: "note"}

#: Rows that also go to the user's log (state records under the user scope), so that later turns of the same
#: user's agent see them: corrections, outside notes, failed attempts and steps that failed for good.
USER_LOGGED = frozenset({CORRECTION, NOTE, ATTEMPT_FAILED, STEP_FAILED})
#: Key prefix of the user's log. The rest of the key is the time inverted (newest first, so a prefix listing
#: reads the most recent entries), then the run and the row: one record per entry, never a shared record that
#: two turns of the user would have to compare-and-set.
USER_LOG_PREFIX = "durable_log:"
_INVERT_MS = 10**13


@dataclass(frozen=True)
class Replay:
    """``begin_step`` answer: this position is already journaled; use ``result`` and do not run the body.

    ``error`` is set when the step had failed for good; the workflow sees the same failure again.
    ``attempts`` is 0 when the result came from another run that used the same explicit idempotency key.
    """

    result: Any
    attempts: int
    error: str | None = None


@dataclass(frozen=True)
class Proceed:
    """``begin_step`` answer: run the body (attempt number ``attempt``), passing ``idempotency_key`` on."""

    attempt: int
    idempotency_key: str


@dataclass(frozen=True)
class Answer:
    """``interrupt`` answer: the interrupt was answered; continue with ``value``."""

    value: Any


@dataclass(frozen=True)
class Suspend:
    """``interrupt`` answer: nobody has answered yet; the run is ``waiting`` and its code must stop here."""

    payload: Any


@dataclass(frozen=True)
class HistoryEntry:
    """One line of a run's history: a step outcome, a failed attempt, an interrupt or a correction."""

    seq: int  # order in the log
    position: int | None  # the workflow position it settled (None for failed attempts and outside notes)
    kind: str  # step | attempt | interrupt | correction | note
    name: str
    status: str
    attempt: int
    result: Any
    error: str | None
    started_at: float
    finished_at: float | None

    @property
    def note(self) -> str | None:
        """The text of a correction or an outside note."""
        return self.result.get("note") if self.kind in ("correction", "note") and isinstance(self.result, dict) else None


def to_json(value: Any, what: str) -> Any:
    """The value as it will read back from the store, so that a live run and its replay see the same thing."""
    try:
        return json.loads(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{what} is not JSON-serialisable: {e}", hint="return plain JSON values (dict, list, str, number, bool, None)") from e


def check_name(name: object, what: str = "step name") -> str:
    return check_id(name, what)


class RunLog:
    """A run and its step log as this executor last wrote or read them."""

    def __init__(self, ts: TenantStore, run: WorkflowRun, rows: list[Step]) -> None:
        self.ts = ts
        self.run = run
        self.rows: list[Step] = []
        self.positions: list[Step] = []
        self._starts: list[int] = []  # for each position, the first log seq that belongs to it
        self._open_start: int | None = None  # first failed attempt of the position not yet settled
        self._tail_failures = 0
        self._key_prefix = "wf:" + hashlib.sha256(ts.tenant_id.encode()).hexdigest()[:8] + ":" + run.id + ":"
        self._user_scope = Scope.for_user(run.scope.agent, run.scope.user) if run.scope.user else None
        for r in rows:
            self._index(r)

    @classmethod
    def load(cls, ts: TenantStore, run_id: str) -> "RunLog":
        # The run before its rows: a row written after we read the version makes our next commit conflict.
        run = ts.runs.get(run_id)
        return cls(ts, run, ts.runs.steps(run_id))

    # -- reading ---------------------------------------------------------------------------------

    def _index(self, row: Step) -> None:
        self.rows.append(row)
        if row.status in POSITIONAL:
            self.positions.append(row)
            self._starts.append(row.seq if self._open_start is None else self._open_start)
            self._open_start, self._tail_failures = None, 0
        elif row.status == ATTEMPT_FAILED:
            if self._open_start is None:
                self._open_start = row.seq
            self._tail_failures += 1

    @property
    def next_seq(self) -> int:
        return self.rows[-1].seq + 1 if self.rows else 0

    def derived_key(self, position: int) -> str:
        """The idempotency key of a step without an explicit one: stable across retries, crashes and hosts."""
        return f"{self._key_prefix}{position}"

    def history(self, before_position: int | None = None) -> list[HistoryEntry]:
        """The log, or only what had been written when the workflow reached ``before_position``."""
        rows = self.rows
        if before_position is not None and before_position < len(self.positions):
            limit = self._starts[before_position]
            rows = [r for r in rows if r.seq < limit]
        pos_of = {p.seq: i for i, p in enumerate(self.positions)}
        return [
            HistoryEntry(r.seq, pos_of.get(r.seq), _KIND.get(r.status, r.status), r.name, r.status, r.attempts,
                         r.result, r.error, r.started_at, r.finished_at)
            for r in rows
        ]

    def waiting_payload(self) -> Any:
        if self.run.status != "waiting" or not self.positions or self.positions[-1].status != WAITING:
            raise RunNotWaiting(self.run.id, self.run.status, self.run.version)
        return self.positions[-1].result.get("payload")

    def _replayed(self, position: int, name: str, kind: str) -> Step | None:
        """The journaled row at ``position`` (checked against what the code asks for), or None when live."""
        if not isinstance(position, int) or position < 0 or position > len(self.positions):
            raise InvalidInput(
                f"position {position!r} of run {self.run.id} is out of order (next is {len(self.positions)})",
                hint="positions count the workflow's step/interrupt/correct calls from 0, one by one",
            )
        if position == len(self.positions):
            return None
        row = self.positions[position]
        if _KIND[row.status] != kind or row.name != name:
            raise NonDeterminismError(self.run.id, position, f"{_KIND[row.status]} {row.name}", f"{kind} {name}")
        return row

    # -- writing ---------------------------------------------------------------------------------

    def _commit(self, write: Callable[[], T], **update: Any) -> T:
        """Run ``write`` and the compare-and-set of the run in one transaction."""
        try:
            with self.ts.transaction():
                out = write()
                new = self.ts.runs.update(self.run.id, expected_version=self.run.version, **update)
        except RunTakenOver:
            raise
        except ConflictError:
            cur = self.ts.runs.get(self.run.id)
            raise RunTakenOver(self.run.id, cur.status, cur.version) from None
        self.run = new
        return out

    def _record(self, seq: int, name: str, status: str, *, attempt: int, result: Any = None, error: str | None = None,
                started_at: float | None = None) -> Step:
        row = self.ts.runs.record_step(self.run.id, seq, name, status, attempts=attempt, result=result, error=error,
                                       started_at=started_at, finished_at=time.time())
        if status in USER_LOGGED and self._user_scope is not None:
            # In the same transaction as the row: the user's log never holds what the run's log does not.
            at = row.finished_at or row.started_at
            entry = {"kind": _KIND[status], "step": name, "status": status, "attempt": attempt, "error": error,
                     "note": result.get("note") if isinstance(result, dict) else None, "turn_id": self.run.id, "at": at}
            key = f"{USER_LOG_PREFIX}{_INVERT_MS - int(at * 1000):013d}:{self.run.id}:{seq}"
            self.ts.state.put(self._user_scope, key, entry, expected_version=0)
        return row

    def mark_running(self) -> None:
        """Take the run: pending or left running by a dead executor becomes running at a new version."""
        if self.run.status in ("pending", "running"):
            self._commit(lambda: None, status="running")

    def release(self) -> None:
        """Give the run back (running -> pending), its journal untouched: nothing executes it now, a later resume
        (a corrected deployment, a restart) may."""
        if self.run.status == "running":
            self._commit(lambda: None, status="pending", current_step=None)

    def begin_step(self, position: int, name: str, idempotency_key: str | None = None) -> Replay | Proceed:
        check_name(name)
        row = self._replayed(position, name, "step")
        if row is not None:
            return Replay(row.result, row.attempts, row.error if row.status == STEP_FAILED else None)
        if idempotency_key is None:
            return Proceed(self._tail_failures + 1, self.derived_key(position))
        entry = self.ts.journal.get(idempotency_key)
        if entry is not None and entry.status == "done":
            # Another run (or an earlier position) already did this side effect: settle this one with its result.
            seq = self.next_seq
            self._index(self._commit(lambda: self._record(seq, name, STEP_OK, attempt=0, result=entry.result),
                                     current_step=name))
            return Replay(entry.result, 0)
        return Proceed(self._tail_failures + 1, idempotency_key)

    def complete_step(self, position: int, name: str, key: str, result: Any, *, attempt: int,
                      started_at: float | None = None, state: dict[str, Any] | None = None) -> Any:
        """Journal a step's result (with the state, if given); returns the result as it will replay."""
        if self._replayed(position, name, "step") is not None:
            raise InvalidInput(f"position {position} of run {self.run.id} is already journaled",
                               hint="call begin_step first and complete only what it told you to run")
        value = to_json(result, f"result of step {name!r}")
        seq = self.next_seq

        def write() -> tuple[Any, Step]:
            effective = value
            # The steps row is the journal of a derived key (it is a function of run and position). An explicit
            # key may be shared with other runs, so it also gets a journal entry that any of them can replay.
            if key != self.derived_key(position):
                entry, created = self.ts.journal.claim(key, run_id=self.run.id, step=name)
                if created or entry.status == "pending":
                    self.ts.journal.complete(key, expected_version=entry.version, result=value)
                elif entry.status == "done":
                    effective = entry.result  # the same key was completed elsewhere first: one outcome per key
            return effective, self._record(seq, name, STEP_OK, attempt=attempt, result=effective, started_at=started_at)

        effective, row = self._commit(write, current_step=name, **_state(state))
        self._index(row)
        return effective

    def fail_step(self, position: int, name: str, error: str, *, attempt: int, final: bool,
                  started_at: float | None = None, state: dict[str, Any] | None = None) -> None:
        """Record a failed attempt; ``final`` settles the position as failed (no more retries)."""
        if self._replayed(position, name, "step") is not None:
            raise InvalidInput(f"position {position} of run {self.run.id} is already journaled")
        seq = self.next_seq
        status = STEP_FAILED if final else ATTEMPT_FAILED
        row = self._commit(lambda: self._record(seq, name, status, attempt=attempt, error=error[:4000], started_at=started_at),
                           current_step=name, **_state(state))
        self._index(row)

    def interrupt(self, position: int, name: str, payload: Any, state: dict[str, Any] | None = None) -> Answer | Suspend:
        check_name(name, "interrupt name")
        row = self._replayed(position, name, "interrupt")
        if row is not None:
            return Answer(row.result.get("answer")) if row.status == ANSWERED else Suspend(row.result.get("payload"))
        payload = to_json(payload, f"payload of interrupt {name!r}")
        seq = self.next_seq
        row = self._commit(lambda: self._record(seq, name, WAITING, attempt=1, result={"payload": payload}),
                           status="waiting", current_step=f"interrupt:{name}", **_state(state))
        self._index(row)
        return Suspend(payload)

    def answer(self, value: Any) -> None:
        """Settle the open interrupt with ``value``; the run becomes pending, ready to resume after it."""
        payload = self.waiting_payload()
        value = to_json(value, "answer")
        last = self.positions[-1]
        row = self._commit(
            lambda: self._record(last.seq, last.name, ANSWERED, attempt=1, result={"payload": payload, "answer": value},
                                 started_at=last.started_at),
            status="pending", current_step=None,
        )
        i = self.rows.index(last)
        self.rows[i] = self.positions[-1] = row

    def correct(self, position: int, note: str, state: dict[str, Any] | None = None) -> None:
        """A correction recorded by the workflow itself at ``position`` (a no-op when replayed)."""
        if self._replayed(position, "correction", "correction") is not None:
            return
        note = _note(note)
        seq = self.next_seq
        self._index(self._commit(lambda: self._record(seq, "correction", CORRECTION, attempt=1, result={"note": note}),
                                 **_state(state)))

    def add_note(self, note: str) -> None:
        """A correction from outside the workflow (the user, an operator), kept in its history."""
        if self.run.status == "running":
            raise ConflictError(
                f"workflow run {self.run.id} is running; an outside correction would race its executor",
                current_version=self.run.version,
                hint="send the correction while the run waits for an answer, or record it from the workflow (ctx.correct)",
            )
        note = _note(note)
        seq = self.next_seq
        self._index(self._commit(lambda: self._record(seq, "note", NOTE, attempt=1, result={"note": note})))

    def checkpoint_state(self, state: dict[str, Any], expected_version: int | None = None) -> int:
        """Save the workflow's variables now; returns the run's new version."""
        if expected_version is not None and expected_version != self.run.version:
            cur = self.ts.runs.get(self.run.id)
            raise RunTakenOver(self.run.id, cur.status, cur.version)
        self._commit(lambda: None, **_state(state))
        return self.run.version

    def finish(self, result: Any, state: dict[str, Any] | None = None) -> None:
        value = to_json(result, "workflow result")
        self._commit(lambda: None, status="succeeded", result=value, error=None, current_step=None, **_state(state))

    def fail(self, error: str, state: dict[str, Any] | None = None, result: Any = None) -> None:
        """Settle the run as failed; ``result``: what a caller asking for it again is to get (e.g. the failure)."""
        extra = {} if result is None else {"result": to_json(result, "workflow result")}
        self._commit(lambda: None, status="failed", error=error[:4000], current_step=None, **_state(state), **extra)


def _state(state: dict[str, Any] | None) -> dict[str, Any]:
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise InvalidInput(f"workflow state must be a dict, got {type(state).__name__}")
    return {"state": state}


def _note(note: object) -> str:
    if not isinstance(note, str) or not note.strip():
        raise InvalidInput("a correction needs a non-empty text", hint="say what should be done differently")
    return note[:4000]


def earlier_entries(ts: TenantStore, run_id: str, *, limit: int = 50) -> list[dict[str, Any]]:
    """The user's log as the run's earlier turns left it: corrections, notes and failures written by other runs
    of the same user's agent before this run was created (oldest first, at most ``limit``, the most recent).

    Entries written after the run was created are left out, so a resumed run reads the same history as its
    first execution did and takes the same path. A run without a user has no such log.
    """
    run = ts.runs.get(run_id)
    if run.scope.user is None:
        return []
    scope = Scope.for_user(run.scope.agent, run.scope.user)
    # Newest first; entries of this run or newer than it are skipped, hence the margin over ``limit``.
    recs = ts.state.list(scope, prefix=USER_LOG_PREFIX, limit=limit + 200)
    out = [r.value for r in recs
           if isinstance(r.value, dict) and r.value.get("turn_id") != run_id and float(r.value.get("at") or 0) < run.created_at]
    return sorted(out[:limit], key=lambda e: e["at"])
