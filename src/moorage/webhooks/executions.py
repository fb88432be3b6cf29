"""Async turns ("executions"): submitted, answered at once with an id, run detached, their events kept.

An execution is a turn like any other (a durable run with the same id), so a host restart resumes it through
``Runtime.recover``; one whose run was never created before a crash is submitted again by ``resubmit_orphans``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
import weakref
from typing import Any

from moorage import clock
from moorage.errors import ConflictError, InvalidInput, MoorageError, NotFound, StoreUnreachable
from moorage.log import get_logger
from moorage.store import EntityKey, Principal, TenantStore
from moorage.store.webhooks import Execution

log = get_logger(__name__)

#: An execution with no run this long after it was submitted was lost before it started (a crash): run it again.
ORPHAN_AFTER_S = 30.0
#: Streamed events are written to the store in batches of at most this many (and at the end).
EVENT_BATCH = 20

#: Refusals of a turn that say "not now" (nothing was started): an accepted execution waits and tries again.
RETRIED_REFUSALS = frozenset({"overloaded", "tenant-awake-limit", "busy"})
#: How long an execution keeps trying after such refusals before it fails with the last one.
REFUSED_RETRY_FOR_S = 900.0

#: Async turns one end-user (of one agent) may have unfinished at once in the fleet; past it a submit is a 429. Each
#: holds a task that waits for its turn (and retries refusals for up to REFUSED_RETRY_FOR_S): unbounded, one end-user
#: token could queue turns (and rows) without end.
MAX_USER_EXECUTIONS = 64

#: The error event's type of an execution cancelled before it started.
CANCELLED = "cancelled"

#: Statuses of an execution as shown to callers: the run's, or ``queued`` before the run exists.
TERMINAL = ("succeeded", "failed", "cancelled")


def _turn_id(principal: Principal, entity: EntityKey, key: str) -> str:
    from moorage.runtime.runtime import _turn_id as runtime_turn_id

    return runtime_turn_id(principal, entity, key)


class ExecutionRunner:
    """Runs executions of one runtime in the background; one per runtime (``ExecutionRunner.of``)."""

    _instances: "weakref.WeakKeyDictionary[Any, ExecutionRunner]" = weakref.WeakKeyDictionary()

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Unfinished executions per (tenant, agent, user) on this host (``MAX_USER_EXECUTIONS``).
        self._per_user: dict[tuple[str, str, str], int] = {}
        self.max_user_executions = int(getattr(getattr(runtime, "config", None), "user_max_async_turns",
                                               MAX_USER_EXECUTIONS))
        #: Executions waiting to be tried again after a "not now" refusal (none of their turn exists meanwhile).
        self._retrying: set[str] = set()
        #: The executions this host drives (id -> its tenant's store, its record): the revoked keys' check reads them.
        self.held: dict[str, tuple[TenantStore, Execution]] = {}

    @classmethod
    def of(cls, runtime: Any) -> "ExecutionRunner":
        runner = cls._instances.get(runtime)
        if runner is None:
            runner = cls._instances[runtime] = cls(runtime)
        return runner

    async def submit(self, principal: Principal, ts: TenantStore, entity: EntityKey, message: str,
                     idempotency_key: str | None) -> tuple[Execution, bool]:
        """Record the execution and start it (True when new). The same Idempotency-Key gives the same one."""
        rt = self.runtime
        rt.router.check_principal(principal, entity)
        # The refusals a turn would give at once (unknown agent or user, nothing deployed) come before the 202.
        agent, _, _ = await asyncio.to_thread(rt.router.resolve, ts, EntityKey(entity.agent, entity.user, "default"))
        if agent.live_deployment is None:
            raise NotFound(f"agent {entity.agent!r} has no live deployment", hint="deploy it with `moorage deploy`")
        key = idempotency_key or f"execution-{uuid.uuid4().hex}"
        session = entity.session or "default"
        exec_id = _turn_id(principal, EntityKey(entity.agent, entity.user, session), key)
        # The key names one turn: asked again with another message it is refused (422), as a synchronous turn is,
        # rather than answered with the first turn while the new message is dropped.
        earlier = await asyncio.to_thread(_earlier_message, ts, exec_id)
        if earlier is not None and earlier != message:
            raise InvalidInput("this Idempotency-Key was used with a different request",
                               hint="use a new key for a new turn")
        if earlier is None and await self._unfinished(ts, entity) >= self.max_user_executions:
            from moorage.router import Overloaded

            raise Overloaded(f"user {entity.user!r} of agent {entity.agent!r} "
                             f"(at most {self.max_user_executions} async turns unfinished at once)",
                             rt.router.retry_after_s)
        from moorage.runtime.revoked_work import starting_key

        ex, created = await asyncio.to_thread(ts.executions.create, exec_id, entity.agent, entity.user, session,
                                              {"message": message, "idempotency_key": key}, starting_key(principal))
        if created:
            self._start(principal, ts, ex)
        return ex, created

    async def _unfinished(self, ts: TenantStore, entity: EntityKey) -> int:
        """The end-user's unfinished async turns: those of the whole fleet (the store's), or this host's where it
        knows of more (submitted here a moment ago). Counted per host, a fleet of N admitted N times as many."""
        here = self._per_user.get(_user_key(ts, entity), 0)
        if here >= self.max_user_executions:
            return here
        return max(here, await asyncio.to_thread(unfinished_of_user, ts, entity.agent, entity.user,
                                                 self.max_user_executions))

    def _start(self, principal: Principal, ts: TenantStore, ex: Execution) -> None:
        if ex.id in self._tasks:
            return
        task = asyncio.create_task(self._drive(principal, ts, ex), name=f"execution-{ex.id}")
        self._tasks[ex.id] = task
        self.held[ex.id] = (ts, ex)
        user = _user_key(ts, EntityKey(ex.agent, ex.user, ex.session))
        self._per_user[user] = self._per_user.get(user, 0) + 1
        from moorage.runtime.revoked_work import RevokedWork

        RevokedWork.of(self.runtime).watch()  # a revoke of the key that started it cancels it here

        def done(_t: "asyncio.Task[None]") -> None:
            self._tasks.pop(ex.id, None)
            self.held.pop(ex.id, None)
            left = self._per_user.pop(user, 1) - 1
            if left:
                self._per_user[user] = left

        task.add_done_callback(done)

    def running(self, execution_id: str) -> bool:
        return execution_id in self._tasks

    async def _drive(self, principal: Principal, ts: TenantStore, ex: Execution) -> None:
        entity = EntityKey(ex.agent, ex.user, ex.session)
        batch: list[Any] = []
        deadline = time.monotonic() + REFUSED_RETRY_FOR_S
        try:
            while True:
                began = False
                try:
                    async for ev in self.runtime.stream(principal, entity, ex.input.get("message", ""),
                                                        idempotency_key=ex.input.get("idempotency_key")):
                        began = True
                        if ev.kind == "done":
                            continue  # the result is the run's own; the GET reads it from there
                        batch.append({"kind": ev.kind, "data": ev.data, "at": clock.now()})
                        if len(batch) >= EVENT_BATCH:
                            await asyncio.to_thread(ts.executions.add_events, ex.id, batch)
                            batch = []
                    return
                except MoorageError as e:
                    # Refused for now (a full queue, every awake instance busy): nothing was started and the 202
                    # promised a turn, so it stays queued and is tried again after the wait the refusal names.
                    # The store out of reach (PostgreSQL restarting) before anything began: tried again the same way.
                    refused = e.code in RETRIED_REFUSALS or isinstance(e, StoreUnreachable)
                    if began or not refused or time.monotonic() >= deadline:
                        raise
                    wait = getattr(e, "retry_after_s", None) or getattr(e, "retry_after", None) or 1.0
                    self._retrying.add(ex.id)  # nothing of it runs now: cancel_queued may stop it here
                    try:
                        await asyncio.sleep(min(float(wait), 30.0) * (1.0 + 0.5 * random.random()))
                    finally:
                        self._retrying.discard(ex.id)
                    if await asyncio.to_thread(_cancelled, ts, ex.id):  # cancelled meanwhile (from another host)
                        return
        except MoorageError as e:
            batch.append({"kind": "error", "data": {"type": e.code, "status": e.http_status, "detail": e.message,
                                                    "hint": e.hint}, "at": clock.now()})
        except Exception as e:  # noqa: BLE001 - recorded on the execution; details stay in the log
            log.exception("execution failed", execution=ex.id)
            batch.append({"kind": "error", "data": {"type": "internal", "status": 500,
                                                    "detail": f"the turn failed ({type(e).__name__})"},
                          "at": clock.now()})
        finally:
            if batch:
                await asyncio.to_thread(ts.executions.add_events, ex.id, batch)

    async def cancel_queued(self, ts: TenantStore, execution_id: str) -> Execution | None:
        """Cancel an async turn that has not started (``queued``: no run yet) while it waits to be tried again after a
        refusal, or is left by a host that stopped: it never runs and reads ``cancelled``. None when its run exists by
        now (cancel the run); a 409 while it waits in its session's line in the runtime (it starts soon)."""
        ex = await asyncio.to_thread(ts.executions.get, execution_id)
        from moorage.runtime import exec_jobs

        if exec_jobs.is_exec(ex):
            raise ConflictError(f"{execution_id!r} is a detached exec, not a turn",
                                hint=f"cancel it with POST /v1/executions/{execution_id}/cancel")
        try:
            await asyncio.to_thread(ts.runs.get, ex.id)
            return None
        except NotFound:
            pass
        task = self._tasks.get(ex.id)
        if task is not None:
            if ex.id not in self._retrying:  # handed to the runtime: it starts once its session's earlier turns end
                raise ConflictError(f"execution {execution_id} is about to start (its session's earlier turns run "
                                    "first) and cannot be stopped before it does",
                                    hint="cancel it once it has started: the same request, when its run_id is set")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if any(e.get("kind") == "error" for e in ex.events):
            status, _ = status_of(ts, ex, False)
            raise ConflictError(f"execution {execution_id} already {status}",
                                hint=f"GET /v1/executions/{execution_id} shows why")
        await asyncio.to_thread(ts.executions.add_events, ex.id, [{"kind": "error", "data": {
            "type": CANCELLED, "status": 409, "detail": "cancelled before it started", "hint": None}, "at": clock.now()}])
        return await asyncio.to_thread(ts.executions.get, ex.id)

    async def cancel_waiting(self, ts: TenantStore, execution_id: str, why: str) -> None:
        """The key that started an async turn not started yet was revoked (``runtime/revoked_work.py``): stopped
        here if it waits to be tried again, and recorded ``cancelled`` with ``why`` unless its run exists by now
        (one still in its session's line is refused as it reaches its instance)."""
        task = self._tasks.get(execution_id)
        if task is not None and execution_id in self._retrying:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        def record() -> None:
            try:
                ts.runs.get(execution_id)
                return  # it started meanwhile: cancelled as a running turn
            except NotFound:
                pass
            try:
                ex = ts.executions.get(execution_id)
            except NotFound:
                return
            if not any(e.get("kind") == "error" for e in ex.events):
                ts.executions.add_events(execution_id, [{"kind": "error", "data": {
                    "type": CANCELLED, "status": 409, "detail": why, "hint": None}, "at": clock.now()}])

        await asyncio.to_thread(record)

    async def resubmit_orphans(self, store: Any, *, min_age_s: float = ORPHAN_AFTER_S) -> int:
        """Start again executions whose run was never created (the host died between the 202 and the run).
        At a host's start nothing of its own is in flight, so ``min_age_s=0`` is right there."""
        count = 0
        cutoff = clock.now() - min_age_s
        for ts in await asyncio.to_thread(lambda: list(store.operator.tenants())):
            # Those with no run, read as such: a host's start read every unsettled execution's run, one query each,
            # before it served (turns waiting for a human stay unsettled for days).
            for ex, _ in await asyncio.to_thread(lambda: list(ts.executions.unsettled_to_act_on(()))):
                if ex.created_at > cutoff or self.running(ex.id) or any(e.get("kind") == "error" for e in ex.events):
                    continue
                self._start(store.operator.principal(ts.tenant_id), ts, ex)
                count += 1
        return count


def unfinished_of_user(ts: TenantStore, agent: str, user: str, limit: int) -> int:
    """How many of the user's async turns are unfinished in the store, whichever host holds them (counted up to
    ``limit``): not announced as ended, with no run yet (queued) or a run pending or running. One refused before
    its run began (an ``error`` event, no run) is over; a run waiting for an answer holds nothing."""
    rows = ts.read("SELECT e.events, r.status FROM executions e LEFT JOIN workflow_runs r ON r.id = e.id "
                   "WHERE e.agent_id = ? AND e.user_id = ? AND (e.announced IS NULL OR e.announced = 'waiting') "
                   "AND (r.status IS NULL OR r.status IN ('pending', 'running')) LIMIT ?", (agent, user, limit + 64))
    n = 0
    for events, status in rows:
        if status is None:
            if isinstance(events, str):
                events = json.loads(events)
            if any(isinstance(e, dict) and e.get("kind") == "error" for e in events or []):
                continue
        n += 1
    return min(n, limit)


def _user_key(ts: TenantStore, entity: EntityKey) -> tuple[str, str, str]:
    return ts.tenant_id, entity.agent, entity.user


def _earlier_message(ts: TenantStore, turn_id: str) -> str | None:
    """The message of the turn this id already names (an execution, or a synchronous turn's run), if any."""
    try:
        return (ts.executions.get(turn_id).input or {}).get("message")
    except NotFound:
        pass
    try:
        return (ts.runs.get(turn_id).input or {}).get("message")
    except NotFound:
        return None


def _refusal(ex: Execution) -> Any:
    """The error event of an execution refused or cancelled before its run existed (None if there is none)."""
    return next((e.get("data") for e in ex.events if e.get("kind") == "error"), None)


def _cancelled(ts: TenantStore, execution_id: str) -> bool:
    try:
        refusal = _refusal(ts.executions.get(execution_id))
    except NotFound:
        return True  # forgotten with its user
    return isinstance(refusal, dict) and refusal.get("type") == CANCELLED


def status_of(ts: TenantStore, ex: Execution, running_here: bool) -> tuple[str, Any]:
    """(status, run or None): the run's status once it exists; before that ``queued``, ``failed`` or
    ``cancelled`` (cancelled before it started)."""
    try:
        run = ts.runs.get(ex.id)
    except NotFound:
        refusal = _refusal(ex)
        if isinstance(refusal, dict) and refusal.get("type") == CANCELLED:
            return "cancelled", None
        if refusal is not None and not running_here:
            return "failed", None
        return "queued", None
    status = "running" if run.status == "pending" else run.status
    return status, run
