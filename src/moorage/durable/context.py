"""What a workflow function sees: ``ctx.step``, ``ctx.interrupt``, ``ctx.state``, ``ctx.history``, ``ctx.correct``.

Each call takes the next position in the run's log; replayed positions return what was journaled.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from functools import lru_cache
from typing import Any, Awaitable, Callable

from moorage.durable.errors import NonDeterminismError, PermanentFailure, RunTakenOver, StepFailed
from moorage.durable.retry import DEFAULT_BACKOFF, Backoff
from moorage.durable.runlog import Answer, HistoryEntry, Replay, RunLog
from moorage.errors import InvalidInput
from moorage.store import Scope


class Suspended(BaseException):
    """Unwinds a workflow that must stop here (waiting for an answer). BaseException: ``except Exception`` in
    workflow code must not swallow it."""


class Halted(BaseException):
    """Unwinds a workflow whose run can no longer be driven by this executor (taken over, cancelled,
    non-deterministic). Carries the error for the engine."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@lru_cache(maxsize=4096)
def _takes_key(fn: Callable[..., Any]) -> bool:
    """Whether the step body wants the idempotency key (a parameter named ``idempotency_key`` or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "idempotency_key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class WorkflowContext:
    """The handle a workflow function receives; valid for one execution of one run."""

    def __init__(self, log: RunLog, rng: random.Random, sleep: Callable[[float], Awaitable[None]]) -> None:
        self._log = log
        self._rng = rng
        self._sleep = sleep
        self._pos = 0
        self._stop: BaseException | None = None
        self.run_id: str = log.run.id
        self.scope: Scope = log.run.scope
        self.input: Any = log.run.input
        #: The workflow's variables, saved with every step. Replay rebuilds it by re-running the code between
        #: journaled steps, so treat it like any local variable that must be deterministic.
        self.state: dict[str, Any] = {}

    @property
    def replaying(self) -> bool:
        """True while the code is being fed journaled results (before the first live step)."""
        return self._pos < len(self._log.positions)

    def _take(self) -> int:
        if self._stop is not None:
            raise self._stop  # the workflow swallowed our unwinding; keep refusing to go on
        pos = self._pos
        self._pos += 1
        return pos

    def _halt(self, error: Exception) -> Halted:
        self._stop = Halted(error)
        return self._stop

    async def step(
        self, name: str, fn: Callable[..., Any], *args: Any, idempotency_key: str | None = None, retries: int = 3,
        backoff: Backoff = DEFAULT_BACKOFF, retry_on: tuple[type[BaseException], ...] = (Exception,), **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` at most until its result is journaled, then never again.

        The result is in the store before this returns. ``fn`` may be sync or async; it receives
        ``idempotency_key=`` when its signature asks for it. A failure is retried ``retries`` times with
        ``backoff`` (each attempt logged); then ``StepFailed`` is raised here.
        """
        if retries < 0:
            raise InvalidInput(f"retries must be >= 0, got {retries}")
        pos = self._take()
        log = self._log
        try:
            decision = log.begin_step(pos, name, idempotency_key)
        except (NonDeterminismError, RunTakenOver) as e:
            raise self._halt(e) from None
        if isinstance(decision, Replay):
            if decision.error is not None:
                raise StepFailed(name, decision.attempts, decision.error)
            return decision.result
        attempt, key = decision.attempt, decision.idempotency_key
        call_kwargs = {**kwargs, "idempotency_key": key} if _takes_key(fn) else kwargs
        while True:
            started = time.time()
            try:
                out = fn(*args, **call_kwargs)
                if inspect.isawaitable(out):
                    out = await out
                return log.complete_step(pos, name, key, out, attempt=attempt, started_at=started, state=self.state)
            except (RunTakenOver, Halted, Suspended, asyncio.CancelledError) as e:
                if isinstance(e, RunTakenOver):
                    raise self._halt(e) from None
                raise
            except BaseException as e:
                if not isinstance(e, Exception):
                    raise  # KeyboardInterrupt, SystemExit: not a step failure
                error = f"{type(e).__name__}: {e}"
                final = attempt > retries or isinstance(e, (PermanentFailure, InvalidInput)) or not isinstance(e, retry_on)
                try:
                    log.fail_step(pos, name, error, attempt=attempt, final=final, started_at=started, state=self.state)
                except RunTakenOver as lost:
                    raise self._halt(lost) from None
                if final:
                    raise StepFailed(name, attempt, error) from e
            await self._sleep(backoff.delay(attempt, self._rng))
            attempt += 1

    async def interrupt(self, payload: Any = None, *, name: str = "approval") -> Any:
        """Ask a human: the run becomes ``waiting`` with ``payload`` and this execution stops here.

        ``engine.answer(run_id, value)`` resumes the run; this call then returns ``value``.
        """
        pos = self._take()
        try:
            out = self._log.interrupt(pos, name, payload, state=self.state)
        except (NonDeterminismError, RunTakenOver) as e:
            raise self._halt(e) from None
        if isinstance(out, Answer):
            return out.value
        self._stop = Suspended(out.payload)
        raise self._stop

    def correct(self, note: str) -> None:
        """Record a user correction in the run's history (once: a replay does not record it again)."""
        pos = self._take()
        try:
            self._log.correct(pos, note, state=self.state)
        except (NonDeterminismError, RunTakenOver) as e:
            raise self._halt(e) from None

    def history(self) -> list[HistoryEntry]:
        """Attempted steps, failures, interrupts and corrections so far (as they stood at this point of the code)."""
        return self._log.history(before_position=self._pos)

    def failures(self, step: str | None = None) -> list[HistoryEntry]:
        """The failed attempts and failed steps so far, optionally for one step name."""
        return [h for h in self.history() if h.error is not None and (step is None or h.name == step)]

    def checkpoint(self) -> None:
        """Save ``ctx.state`` now, without a step (e.g. before a long wait outside any step)."""
        if self.replaying:
            return
        try:
            self._log.checkpoint_state(self.state)
        except RunTakenOver as e:
            raise self._halt(e) from None
