"""The durable engine: start, resume, answer, cancel and recover workflow runs of one tenant.

In-process workflows are ``async def wf(ctx, input)``; the same primitives (begin_step, complete_step,
fail_step, interrupt, checkpoint_state) are plain methods for the host side of the guest channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from moorage.durable.context import Halted, Suspended, WorkflowContext
from moorage.durable.errors import NonDeterminismError, RunCancelled, RunTakenOver, WorkflowNotRegistered
from moorage.durable.runlog import TERMINAL, Answer, HistoryEntry, Proceed, Replay, RunLog, Suspend, check_name
from moorage.errors import ConflictError, MoorageError
from moorage.log import get_logger
from moorage.store import Scope, TenantStore, WorkflowRun

log = get_logger(__name__)

Workflow = Callable[[WorkflowContext, Any], Awaitable[Any]]


@dataclass
class RecoveryReport:
    """What ``recover`` did with each run it found unfinished."""

    resumed: list[WorkflowRun] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # run id -> why it could not be resumed
    unregistered: list[str] = field(default_factory=list)  # run ids whose workflow name has no function here


class DurableEngine:
    """Drives the workflow runs of one tenant (``ts``) with journaled steps."""

    def __init__(
        self, ts: TenantStore, workflows: Mapping[str, Workflow] | None = None, *, rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.ts = ts
        self._workflows: dict[str, Workflow] = dict(workflows or {})
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._active: dict[str, asyncio.Task[WorkflowRun]] = {}
        self._cancelled: set[str] = set()
        self._channel_logs: dict[str, RunLog] = {}

    # -- registry --------------------------------------------------------------------------------

    def register(self, name: str, fn: Workflow | None = None) -> Any:
        """Register ``fn`` under ``name`` (usable as ``@engine.register("name")``)."""
        check_name(name, "workflow name")

        def add(f: Workflow) -> Workflow:
            self._workflows[name] = f
            return f

        return add(fn) if fn is not None else add

    def _fn(self, name: str, fn: Workflow | None) -> Workflow:
        if fn is not None:
            self._workflows.setdefault(name, fn)
            return fn
        found = self._workflows.get(name)
        if found is None:
            raise WorkflowNotRegistered(name)
        return found

    # -- the in-process API ----------------------------------------------------------------------

    async def start(self, scope: Scope, name: str, fn: Workflow | None = None, input: Any = None, *,
                    run_id: str | None = None) -> WorkflowRun:
        """Create a run and execute it until it finishes, waits for an answer, fails or is cancelled.

        Starting an existing run id of the same workflow resumes it, so a caller may retry ``start`` safely.
        """
        fn = self._fn(name, fn)
        rid = run_id or (scope.ref if scope.kind == "workflow" else None)
        try:
            run = self.ts.runs.create(scope, name, input, run_id=rid)
            runlog = RunLog(self.ts, run, [])
        except ConflictError:
            runlog = RunLog.load(self.ts, rid)  # type: ignore[arg-type]  # create only conflicts with an id
            if runlog.run.name != name:
                raise ConflictError(
                    f"workflow run {rid} exists for workflow {runlog.run.name!r}, not {name!r}",
                    current_version=runlog.run.version, hint="use a new run id",
                ) from None
        return await self._drive(runlog, fn)

    async def resume(self, run_id: str, fn: Workflow | None = None) -> WorkflowRun:
        """Continue a run from its journal: journaled positions replay, the rest executes."""
        runlog = RunLog.load(self.ts, run_id)
        return await self._drive(runlog, self._fn(runlog.run.name, fn))

    async def answer(self, run_id: str, value: Any, fn: Workflow | None = None, *, resume: bool = True) -> WorkflowRun:
        """Answer the run's open interrupt and (unless ``resume=False``) continue it right after the interrupt."""
        self._channel_logs.pop(run_id, None)  # written here, not through the channel's copy
        runlog = RunLog.load(self.ts, run_id)
        runlog.answer(value)
        if not resume:
            return runlog.run
        return await self._drive(runlog, self._fn(runlog.run.name, fn))

    def cancel(self, run_id: str, reason: str = "cancelled by request") -> WorkflowRun:
        """Cancel a run that has not finished; an executor driving it stops at its next journal write.

        A finished run is returned as it is.
        """
        self._channel_logs.pop(run_id, None)
        while True:
            run = self.ts.runs.get(run_id)
            if run.status in TERMINAL:
                return run
            try:
                run = self.ts.runs.update(run_id, expected_version=run.version, status="cancelled", error=reason)
                break
            except ConflictError:
                continue  # it moved on meanwhile; look again
        self._cancelled.add(run_id)
        task = self._active.get(run_id)
        if task is not None:
            task.cancel()
        log.info("workflow run cancelled", run_id=run_id)
        return run

    def correct(self, run_id: str, note: str) -> None:
        """Record a correction from outside (e.g. the user, while the run waits); the workflow sees it in history."""
        self._channel_logs.pop(run_id, None)
        RunLog.load(self.ts, run_id).add_note(note)

    def get(self, run_id: str) -> WorkflowRun:
        return self.ts.runs.get(run_id)

    def history(self, run_id: str) -> list[HistoryEntry]:
        # A run this engine drives for a guest: its log is here, extended by each of its writes (a write by another
        # executor makes our next one fail and drops this copy), so a guest's history call does not re-read the
        # run's whole log each time.
        runlog = self._channel_logs.get(run_id)
        return (runlog if runlog is not None else RunLog.load(self.ts, run_id)).history()

    def waiting_for(self, run_id: str) -> Any:
        """The payload of the interrupt the run is waiting at (``RunNotWaiting`` if it is not)."""
        return RunLog.load(self.ts, run_id).waiting_payload()

    async def recover(self, workflows: Mapping[str, Workflow] | None = None, *, limit: int = 1000) -> RecoveryReport:
        """Resume every run left ``pending`` or ``running`` (e.g. by a crashed host), one after the other.

        In a fleet, call this only for runs whose host is known to be gone: a run still driven elsewhere is
        taken over (the other executor then stops at its next write, having lost the compare-and-set).
        """
        registry = {**self._workflows, **(workflows or {})}
        report = RecoveryReport()
        for run in self.ts.runs.list(status=["pending", "running"], limit=limit):
            fn = registry.get(run.name)
            if fn is None:
                report.unregistered.append(run.id)
                continue
            try:
                report.resumed.append(await self.resume(run.id, fn))
            except MoorageError as e:
                report.errors[run.id] = str(e)
                log.warning("could not resume workflow run", run_id=run.id, error=str(e))
        return report

    # -- executing -------------------------------------------------------------------------------

    async def _drive(self, runlog: RunLog, fn: Workflow) -> WorkflowRun:
        run_id = runlog.run.id
        if runlog.run.status in TERMINAL:
            return runlog.run
        if run_id in self._active:
            raise ConflictError(f"workflow run {run_id} is already executing in this engine",
                                hint="await the first execution instead of starting another")
        runlog.mark_running()
        task = asyncio.ensure_future(self._execute(runlog, fn))
        self._active[run_id] = task
        try:
            return await task
        finally:
            self._active.pop(run_id, None)
            self._cancelled.discard(run_id)

    async def _execute(self, runlog: RunLog, fn: Workflow) -> WorkflowRun:
        ctx = WorkflowContext(runlog, self._rng, self._sleep)
        try:
            try:
                result = await fn(ctx, ctx.input)
            except Suspended:
                return runlog.run
            except Halted as h:
                if isinstance(h.error, NonDeterminismError):
                    with contextlib.suppress(RunTakenOver):  # another executor has it: nothing to give back
                        runlog.release()  # pending, as the guest's runs are: nothing executes it until a fixed resume
                raise h.error from None
            except asyncio.CancelledError:
                if runlog.run.id in self._cancelled:
                    return self.ts.runs.get(runlog.run.id)
                raise
            except Exception as e:  # the workflow's own failure: the run ends failed, with the reason
                runlog.fail(f"{type(e).__name__}: {e}", ctx.state)
                return runlog.run
            try:
                runlog.finish(result, ctx.state)
            except MoorageError as e:
                if isinstance(e, RunTakenOver):
                    raise
                runlog.fail(str(e), ctx.state)  # e.g. a result that is not JSON
            return runlog.run
        except RunTakenOver as e:
            if e.status == "cancelled":
                return self.ts.runs.get(runlog.run.id)
            raise

    # -- primitives for the guest channel --------------------------------------------------------
    # The guest runs the workflow code and counts positions itself; the host journals. A RunLog is kept per
    # run between calls and dropped when another executor takes the run over.

    def create_run(self, scope: Scope, name: str, input: Any = None, *, run_id: str | None = None) -> WorkflowRun:
        return self.ts.runs.create(scope, name, input, run_id=run_id)

    def open_run(self, run_id: str) -> WorkflowRun:
        """Load a run for a guest executor and take it (pending/running -> running); returns it. A cancelled run
        is not taken (``RunCancelled``): its canceller was told it stopped."""
        runlog = RunLog.load(self.ts, run_id)
        if runlog.run.status == "cancelled":
            raise RunCancelled(run_id, runlog.run.version)
        if runlog.run.status not in TERMINAL:
            self._guarded(runlog, runlog.mark_running)
        self._channel_logs[run_id] = runlog
        return runlog.run

    def _channel(self, run_id: str) -> RunLog:
        runlog = self._channel_logs.get(run_id)
        if runlog is None:
            runlog = self._channel_logs[run_id] = RunLog.load(self.ts, run_id)
        return runlog

    def _guarded(self, runlog: RunLog, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except MoorageError:
            self._channel_logs.pop(runlog.run.id, None)  # re-read from the store on the next call
            raise

    def begin_step(self, run_id: str, seq: int, name: str, idempotency_key: str | None = None) -> Replay | Proceed:
        runlog = self._channel(run_id)
        return self._guarded(runlog, runlog.begin_step, seq, name, idempotency_key)

    def complete_step(self, run_id: str, seq: int, name: str, result: Any, *, idempotency_key: str | None = None,
                      attempt: int = 1, started_at: float | None = None, state: dict[str, Any] | None = None) -> Any:
        runlog = self._channel(run_id)
        key = idempotency_key or runlog.derived_key(seq)
        return self._guarded(runlog, runlog.complete_step, seq, name, key, result, attempt=attempt,
                             started_at=started_at, state=state)

    def fail_step(self, run_id: str, seq: int, name: str, error: str, *, attempt: int, final: bool,
                  started_at: float | None = None, state: dict[str, Any] | None = None) -> None:
        runlog = self._channel(run_id)
        self._guarded(runlog, runlog.fail_step, seq, name, error, attempt=attempt, final=final,
                      started_at=started_at, state=state)

    def interrupt(self, run_id: str, seq: int, payload: Any, *, name: str = "approval",
                  state: dict[str, Any] | None = None) -> Answer | Suspend:
        runlog = self._channel(run_id)
        return self._guarded(runlog, runlog.interrupt, seq, name, payload, state)

    def record_correction(self, run_id: str, seq: int, note: str, state: dict[str, Any] | None = None) -> None:
        runlog = self._channel(run_id)
        self._guarded(runlog, runlog.correct, seq, note, state)

    def checkpoint_state(self, run_id: str, state: dict[str, Any], expected_version: int) -> int:
        """Save a guest's workflow variables (compare-and-set on the run's version); returns the new version."""
        runlog = self._channel(run_id)
        return self._guarded(runlog, runlog.checkpoint_state, state, expected_version)

    def finish_run(self, run_id: str, result: Any, state: dict[str, Any] | None = None) -> WorkflowRun:
        runlog = self._channel(run_id)
        self._guarded(runlog, runlog.finish, result, state)
        self._channel_logs.pop(run_id, None)
        return runlog.run

    def fail_run(self, run_id: str, error: str, state: dict[str, Any] | None = None, result: Any = None) -> WorkflowRun:
        runlog = self._channel(run_id)
        self._guarded(runlog, runlog.fail, error, state, result)
        self._channel_logs.pop(run_id, None)
        return runlog.run
