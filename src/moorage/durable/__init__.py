"""Durable workflows: journaled steps, idempotency keys, retries, interrupts and recovery after a crash.

``engine = DurableEngine(ts)``; ``await engine.start(scope, "name", wf, input)`` with ``async def wf(ctx, input)``.
"""

from __future__ import annotations

from moorage.durable.context import WorkflowContext
from moorage.durable.engine import DurableEngine, RecoveryReport, Workflow
from moorage.durable.errors import (
    NonDeterminismError,
    PermanentFailure,
    RunCancelled,
    RunNotWaiting,
    RunTakenOver,
    StepFailed,
    WorkflowNotRegistered,
)
from moorage.durable.retry import DEFAULT_BACKOFF, NO_WAIT, Backoff
from moorage.durable.runlog import Answer, HistoryEntry, Proceed, Replay, Suspend

__all__ = [
    "DEFAULT_BACKOFF", "NO_WAIT", "Answer", "Backoff", "DurableEngine", "HistoryEntry", "NonDeterminismError",
    "PermanentFailure", "Proceed", "RecoveryReport", "Replay", "RunCancelled", "RunNotWaiting", "RunTakenOver", "StepFailed",
    "Suspend", "Workflow", "WorkflowContext", "WorkflowNotRegistered",
]
