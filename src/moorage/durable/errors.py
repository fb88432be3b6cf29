"""Errors raised by the durable engine, each with what the caller should do next.

All subclass ``moorage.errors`` types so the API maps them to the right HTTP status.
"""

from __future__ import annotations

from moorage.errors import ConflictError, MoorageError, NotFound


class NonDeterminismError(MoorageError):
    """Replayed workflow code asked for a different step than the one journaled at that position.

    The journal is left untouched and the run pending, so that a corrected deployment can resume it.
    """

    code = "non-determinism"
    http_status = 409

    def __init__(self, run_id: str, position: int, journaled: str, requested: str) -> None:
        super().__init__(
            f"workflow run {run_id} is not deterministic: position {position} was journaled as {journaled!r} "
            f"but the code now asks for {requested!r}",
            hint="workflow code must call the same steps in the same order on every execution; move "
            "non-deterministic choices (time, randomness, I/O) into a ctx.step, or start a new run",
        )
        self.run_id = run_id
        self.position = position
        self.journaled = journaled
        self.requested = requested


class StepFailed(MoorageError):
    """A step failed on every attempt it was allowed; raised into the workflow, which may take another path."""

    code = "step-failed"
    http_status = 500

    def __init__(self, step: str, attempts: int, error: str) -> None:
        super().__init__(
            f"step {step!r} failed after {attempts} attempt(s): {error}",
            hint="catch StepFailed in the workflow to take another path, or look at ctx.history()",
        )
        self.step = step
        self.attempts = attempts
        self.error = error


class PermanentFailure(Exception):
    """Raise from a step body to fail it at once, without the remaining retries (e.g. a 4xx answer)."""


class RunTakenOver(ConflictError):
    """Another executor advanced or changed this run first; this one stops without writing anything."""

    code = "run-taken-over"

    def __init__(self, run_id: str, status: str, current_version: int | None) -> None:
        super().__init__(
            f"workflow run {run_id} was changed by someone else (now {status}, version {current_version})",
            current_version=current_version,
            hint="only one executor may drive a run; the other one continues it",
        )
        self.run_id = run_id
        self.status = status


class RunCancelled(ConflictError):
    """An executor was to take a run someone cancelled meanwhile (an answer racing a cancel, a retried turn's
    Idempotency-Key): it does not run, so nothing the cancel's caller was told stopped happens after all."""

    code = "run-cancelled"

    def __init__(self, run_id: str, current_version: int | None) -> None:
        super().__init__(f"workflow run {run_id} was cancelled; it does not run again", current_version=current_version,
                         hint="start a new turn (with a new Idempotency-Key) to do it after all")
        self.run_id = run_id


class RunNotWaiting(ConflictError):
    """``answer`` was called for a run that is not waiting at an interrupt (already answered, or never asked)."""

    code = "run-not-waiting"

    def __init__(self, run_id: str, status: str, current_version: int | None) -> None:
        super().__init__(
            f"workflow run {run_id} is {status}, not waiting for an answer",
            current_version=current_version,
            hint="answer a run only while its status is 'waiting'; read it again to see where it is",
        )


class WorkflowNotRegistered(NotFound):
    """The engine has no function for a run's workflow name, so it cannot resume it."""

    code = "workflow-not-registered"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"no workflow function registered under {name!r}",
            hint="pass the function to engine.resume(..., fn) or register it: DurableEngine(ts, {name!r: fn})",
        )


__all__ = [
    "NonDeterminismError", "PermanentFailure", "RunNotWaiting", "RunTakenOver", "StepFailed",
    "WorkflowNotRegistered",
]
