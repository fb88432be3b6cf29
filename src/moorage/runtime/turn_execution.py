"""A turn run inside its sandbox, as ``Runtime`` does it for the router: its durable run, its two commits (before the
agent runs, and after it answered, before the reply goes out), and the call to the agent in the guest."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from moorage.durable import DurableEngine, RunCancelled, RunTakenOver
from moorage.errors import ConflictError, DiskFull, MoorageError, disk_full
from moorage.log import get_logger
from moorage.runtime import instance_update
from moorage.runtime.host_calls import GuestCalls, TurnBinding
from moorage.runtime.turns import (
    _LIMIT_KINDS,
    NOT_LOADED,
    AgentTurnFailed,
    OnWakeTimedOut,
    SandboxStopped,
    TurnEvent,
    TurnLimited,
    TurnResult,
    TurnTimedOut,
    _raise_agent_failure,
    _Turn,
)
from moorage.runtime.package import turn_timeout_s
from moorage.sandbox import ChannelClosed, ChannelError, ChannelTimeout, RemoteError, Sandbox, SandboxStateError
from moorage.store import EventIn, Scope, TenantStore


class TurnReaderCancelled(Exception):
    """The agent's turn was cancelled in the guest because its run was cancelled (``Runtime.cancel``)."""


log = get_logger(__name__)

#: How often a turn whose end did not fit the disk tries again to record it failed.
END_RETRY_S = 1.0
#: Those tries in flight (held: asyncio keeps weak references to tasks).
_ENDING: set["asyncio.Task[None]"] = set()
#: How long a guest has to answer after one of its turns timed out, before it is taken as stuck and stopped.
STUCK_CHECK_S = 5.0
#: How much of a failed turn's error its span keeps (the run keeps it whole).
SPAN_ERROR_CHARS = 1000


def _error_attrs(error: BaseException) -> dict[str, Any]:
    """What a failed turn's span says of its failure: the error's type, and for moorage's own errors (the agent's
    exception with its line, a limit, a stopped sandbox) its code, message and hint, as request spans say them."""
    attrs: dict[str, Any] = {"error": type(error).__name__}
    if isinstance(error, MoorageError):
        attrs.update({"error.code": error.code, "error.message": error.message[:SPAN_ERROR_CHARS]})
        if error.hint:
            attrs["error.hint"] = error.hint[:SPAN_ERROR_CHARS]
    return attrs


class TurnExecution:
    """``Runtime``'s run of one turn in its sandbox (a part of it: it reads the runtime's instances, memory tiers,
    tracer, turns in flight and time travel)."""

    async def _forward_turn(self, sandbox: Sandbox, turn: _Turn) -> TurnResult:
        """The router's forward: run ``turn`` in ``sandbox`` under a durable run it owns, stream events back.

        The turn's own writes are two commits: before the agent runs (``_begin_turn``) and after it answered,
        before the reply goes out (``_end_turn``). Host calls in between (steps, interrupts) commit when they
        happen; the turn's messages are embedded after the reply, in the background.
        """
        ts, turn_id = turn.ts, turn.turn_id
        self._loop = asyncio.get_running_loop()  # model-backed memory helpers call the gateway on this loop
        # The durable engine owns the run's state from here: it takes the run, journals steps and interrupts,
        # and finishes it; this executor loses the run if another one takes it over.
        engine = DurableEngine(ts, rng=self.rng)
        started = time.perf_counter()
        memory = self.memory(ts)
        binding, replayed = await asyncio.to_thread(self._prepare_turn, engine, sandbox.id, turn)
        if replayed is not None:
            return replayed
        self.turns[turn_id] = binding
        self.activity.begin(ts.tenant_id)
        self.tracer.open(turn_id)
        async def read() -> dict[str, Any]:
            out: dict[str, Any] = {}
            async for item in self.forward(sandbox, binding, turn.message):
                if isinstance(item, TurnEvent):
                    if item.kind == "tool":  # a tool the agent ran in its sandbox: traced like host calls
                        tool = (item.data.get("data") or {}).get("name") if isinstance(item.data, dict) else None
                        self.tracer.span(binding, "tool", time.perf_counter(), tool=str(tool))
                    turn.events.put_nowait(item)
                else:
                    out = item
            return out

        try:
            try:
                # Its own task: a cancel of the run cancels it, and leaving the guest's call cancels the agent there.
                binding.reader = asyncio.create_task(read())
                try:
                    out = await asyncio.shield(binding.reader)
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if me is not None and me.cancelling():  # this turn itself is being cancelled: not the run
                        binding.reader.cancel()
                        raise
                    raise TurnReaderCancelled() from None
            except Exception as e:
                if binding.diverged is not None:
                    # Replayed code that asked for other steps than the journal holds: the run is left pending for
                    # a corrected deployment (the same turn asked again, or the host's next start, resumes it).
                    await asyncio.to_thread(self._end_turn, engine, binding, started, diverged=binding.diverged)
                    raise binding.diverged from e
                if await self._end_turn_or_later(engine, binding, started, error=e):
                    raise RunCancelled(turn_id, None) from e  # cancelled while it ran: what ended it
                if isinstance(e, ChannelClosed):  # said as what it is, not as the server's failure
                    raise SandboxStopped(e.message.split(": ", 1)[-1]) from e
                raise
            if out.get("status") == "waiting":  # the engine already set the run waiting at the interrupt
                await asyncio.to_thread(self._end_turn, engine, binding, started, waiting=True)
                result = TurnResult(turn_id, "waiting", None, turn.trace_id, out.get("interrupt"), turn_id,
                                    dict(binding.usage))
            else:
                reply = out.get("reply")
                await self._end_turn_or_later(engine, binding, started, reply=reply)
                result = TurnResult(turn_id, "done", reply, turn.trace_id, None, turn_id, dict(binding.usage))
            if turn.answered is not None and not turn.answered.done() and self.timetravel.will_checkpoint(binding):
                turn.answered.set_result(result)  # the reply goes out before the checkpoint below
            await self.timetravel.after_turn(sandbox, binding)  # still holding the instance; never raises
            return result
        finally:
            if self.turns.pop(turn_id, None) is not None:
                self.activity.end(ts.tenant_id)
            self._working.pop(turn_id, None)
            self.tracer.close(turn_id)
            self.embed_queue.submit(memory.episodic)  # the turn's messages, now that the reply is out

    def _prepare_turn(self, engine: DurableEngine, sandbox_id: str, turn: _Turn) -> tuple[TurnBinding, TurnResult | None]:
        """The turn's binding to its deployment, then its first commit (``_begin_turn``): one worker-thread hop."""
        ts = turn.ts
        deployment = ts.deployments.get(ts.agents.get(turn.entity.agent).live_deployment)
        binding = TurnBinding(turn.turn_id, sandbox_id, ts, turn.entity, turn.turn_id, deployment.id,
                              deployment.manifest, turn.trace_id, engine)
        # Facts are extracted before the transaction: a model-backed extractor must not hold the store's lock.
        facts = [] if turn.resume else self.memory(ts).semantic.extractor.extract(turn.message, speaker="user")
        return binding, self._begin_turn(engine, binding, turn, facts)

    def _begin_turn(self, engine: DurableEngine, b: TurnBinding, turn: _Turn, facts: list[Any]) -> TurnResult | None:
        """The turn's first commit: its run created (or taken) and running, the session touched, the user's
        message logged (to be embedded later) with the facts it states. None: run the turn; a result: the
        same turn (same Idempotency-Key) finished meanwhile, and this is its outcome."""
        from moorage.memory.semantic import TurnRef, origin_of

        ts = b.ts
        try:
            with ts.transaction():
                self._fence(ts, b.sandbox_id)
                if turn.create:
                    ts.runs.create(Scope.workflow(turn.entity.agent, turn.turn_id, user=turn.entity.user), "turn",
                                   {"message": turn.message, "session": turn.entity.session, "trace_id": b.trace_id},
                                   run_id=turn.turn_id)
                engine.open_run(turn.turn_id)
                if not turn.resume:
                    ts.sessions.open(turn.entity.agent, turn.entity.user, turn.entity.session)
                    mem = self._writer(ts)
                    (ev,) = mem.episodic.remember_pending(b.session_scope, [EventIn("message", turn.message, "user")])
                    for cand in facts:
                        mem.semantic.record(b.user_scope, cand, origin=origin_of(ev), evidence=[str(ev.id)],
                                            valid_from=ev.ts, turn=TurnRef(b.run_id, b.trace_id))
        except ConflictError:
            run = self._existing_run(ts, turn.turn_id) if turn.create else None
            if run is None:
                raise
            # A request with the same Idempotency-Key created the run first.
            if run.status in ("succeeded", "waiting"):
                return self._result_of(ts, run)
            _raise_agent_failure(run)
            if run.status in ("running", "pending") and turn.turn_id in self.turns:
                raise ConflictError("this turn is already running", hint="retry later with the same Idempotency-Key")
            turn.create = False
            return self._begin_turn(engine, b, turn, facts)
        return None

    def _fence(self, ts: TenantStore, sandbox_id: str) -> None:
        """Fleet: the turn's commit holds only while this host still owns the instance under the epoch it woke
        it with (``LeaseLost`` otherwise); the check locks the record until the commit, so no takeover slips in."""
        lease = self.instances.lease(sandbox_id)
        if lease is not None:
            ts.sandboxes.fence(sandbox_id, *lease)

    async def _end_turn_or_later(self, engine: DurableEngine, b: TurnBinding, started: float, **how: Any) -> bool:
        """``_end_turn``, and when the disk is too full for it, ``DiskFull`` (the caller's 507) and the run recorded
        failed once there is room. It stayed ``running``: an async turn read ``running`` until the host restarted,
        and the restart ran the turn again although its caller had been told it failed."""
        try:
            return await asyncio.to_thread(self._end_turn, engine, b, started, **how)
        except Exception as e:
            full = disk_full(e)
            if full is None:
                raise
            task = asyncio.get_running_loop().create_task(self._fail_when_room(engine, b, started, full),
                                                          name=f"turn-end-{b.run_id}")
            _ENDING.add(task)
            task.add_done_callback(_ENDING.discard)
            raise full from e

    async def _fail_when_room(self, engine: DurableEngine, b: TurnBinding, started: float, full: DiskFull) -> None:
        while True:
            await asyncio.sleep(END_RETRY_S)
            try:
                await asyncio.to_thread(self._end_turn, engine, b, started, error=full)
                log.info("turn recorded failed now that the disk has room", run=b.run_id)
                return
            except Exception as e:  # noqa: BLE001 - still full: try again; anything else: the restart resumes it
                if disk_full(e) is None:
                    log.warning("could not record a turn failed for a full disk", run=b.run_id, error=str(e))
                    return

    def _end_turn(self, engine: DurableEngine, b: TurnBinding, started: float, *, reply: Any = None,
                  waiting: bool = False, error: BaseException | None = None,
                  diverged: BaseException | None = None) -> bool:
        """The turn's last commit, before its reply goes out: the reply logged (to be embedded later), working
        memory, the run's result and the turn's spans, in one transaction. A failed turn records its failure
        and spans; a waiting one (its interrupt is already journaled) only its spans. A run cancelled while the
        turn ran stays cancelled: its failure is not recorded over it (True is returned), and its reply is not
        kept (``RunCancelled``)."""
        ts = b.ts
        cancelled = False
        with ts.transaction():
            self._fence(ts, b.sandbox_id)
            if diverged is not None:
                run = ts.runs.get(b.run_id)
                if run.status == "running":
                    ts.runs.update(b.run_id, expected_version=run.version, status="pending")
                self.tracer.span(b, "turn", started, status="error", **_error_attrs(diverged))
            elif error is not None:
                cancelled = ts.runs.get(b.run_id).status == "cancelled"
                if cancelled:
                    self.tracer.span(b, "turn", started, status="cancelled")
                else:
                    failure = ({"failure": {"code": error.code, "message": error.message, "hint": error.hint}}
                               if isinstance(error, AgentTurnFailed) else None)
                    engine.fail_run(b.run_id, str(error), result=failure)
                    self.tracer.span(b, "turn", started, status="error", **_error_attrs(error))
            elif waiting:
                self.tracer.span(b, "turn", started, status="waiting")
            else:
                said = reply if isinstance(reply, str) and reply else None
                if said is not None:
                    self._writer(ts).episodic.remember_pending(b.session_scope, [EventIn("message", said, "assistant")])
                self._remember_reply(b, said)
                try:
                    engine.finish_run(b.run_id, {"reply": reply, "trace_id": b.trace_id, "usage": dict(b.usage)})
                except RunTakenOver as e:
                    if e.status == "cancelled":  # the reply is not kept: the transaction goes back
                        raise RunCancelled(b.run_id, None) from None
                    raise
                self.tracer.span(b, "turn", started, status="done")
            self.tracer.flush(b)
        return cancelled

    async def forward(self, sandbox: Sandbox, binding: TurnBinding, message: str) -> AsyncIterator[Any]:
        """Send one turn to the agent in ``sandbox``; yields TurnEvents, then the guest's result dict."""
        def register(channel: Any) -> None:
            GuestCalls(self, sandbox.id, binding.ts.tenant_id).register(channel)

        register(sandbox.channel)
        params = {"deployment_id": binding.deployment_id, "turn_id": binding.turn_id, "message": message,
                  "entity": {"agent": binding.entity.agent, "user": binding.entity.user, "session": binding.entity.session}}
        bound = turn_timeout_s(binding.manifest)
        for attempt in (1, 2):
            # A fork of the deployment's template already has its code loaded (the template was snapshotted with
            # it), and so has an instance that ran it before a sleep: the turn is sent straight away, and only a
            # guest that answers NOT_LOADED (a cold boot, a redeploy) gets the code pushed before the second try.
            # A guest may run an older moorage's guest code (re-adopted after a live upgrade, woken from an older
            # snapshot, forked from an older template; an app request may have served it already): load() restarts
            # it onto this host's first. A read of the sandbox's record, in memory.
            if self._loaded.get(sandbox.id) not in (None, binding.deployment_id) or attempt == 2 or \
                    instance_update.guest_code_behind(self, sandbox):
                dep = await asyncio.to_thread(binding.ts.deployments.get, binding.deployment_id)
                # Its packages made the deployment's first (a redeploy may have changed them: a restart).
                await instance_update.load(self, sandbox, dep, binding.ts, on_restart=register)
            self._loaded[sandbox.id] = binding.deployment_id
            try:
                # Counted while it runs: a redeploy's change of the sandbox waits for it (instance_update.drain).
                with instance_update.in_turn(sandbox.id):
                    async with sandbox.channel.stream("agent.turn", params, timeout=bound) as call:
                        async for ev in call:
                            yield TurnEvent("event" if ev.event not in ("token", "tool") else ev.event,
                                            {"event": ev.event, "data": ev.data})
                        result = call.result
                break
            except ChannelTimeout:  # the call was cancelled in the guest as it timed out
                if await _restart_if_stuck(sandbox, binding):
                    raise OnWakeTimedOut(bound) from None
                raise TurnTimedOut(bound) from None
            except RemoteError as e:
                if e.rpc_code == NOT_LOADED and attempt == 1:
                    # The guest restarted since we loaded it (cold wake, host restart): load and go again.
                    self._loaded.pop(sandbox.id, None)
                    continue
                data = e.data if isinstance(e.data, dict) else {}
                if data.get("kind") in _LIMIT_KINDS:  # the agent let a limit on its own call end the turn
                    wait = data.get("retry_after")
                    raise TurnLimited(e.message, code=str(data["kind"]), hint=data.get("hint"),
                                      retry_after=float(wait) if isinstance(wait, (int, float)) else None) from e
                raise AgentTurnFailed(e.message, hint=_agent_error_hint(data)) from e
        yield result


async def _restart_if_stuck(sandbox: Sandbox, binding: TurnBinding) -> bool:
    """After a turn timed out (and was cancelled in the guest): a guest whose event loop does not answer (the agent's
    async code blocked it: time.sleep, a busy loop) or whose timed-out code still runs in a thread (a plain-function
    handler cannot be cancelled) is stopped, so the user's next turn starts it afresh instead of waiting behind it.
    Returns whether the guest says the turn was still waiting on the agent's ``on_wake`` (only the error's words
    follow from it)."""
    blocked, in_wake = False, False
    try:
        info = await sandbox.channel.call("agent.info", {"turn_id": binding.turn_id}, timeout=STUCK_CHECK_S)
    except ChannelTimeout:
        why, blocked = "its event loop does not answer (the agent's code blocks it)", True
    except (ChannelError, SandboxStateError):
        return False  # stopped or closed already: the next turn starts it
    else:
        in_wake = isinstance(info, dict) and info.get("in_on_wake") is True
        if not (isinstance(info, dict) and info.get("stuck")):
            return in_wake
        why = "the agent's code still runs in a thread the turn's cancel cannot stop"
    log.warning("stopping the sandbox of a timed-out turn: %s (the user's next turn starts it afresh)" % why,
                sandbox=sandbox.id, agent=binding.entity.agent, user=binding.entity.user, turn=binding.turn_id)
    try:
        if blocked:  # it would not answer the stop's sync of its files either: not waited for
            await sandbox.channel.close("its event loop is blocked")
        await sandbox.stop()
    except Exception as e:  # noqa: BLE001 - the turn is answered anyway; the next one finds it as it is
        log.error("could not stop the sandbox of a timed-out turn", sandbox=sandbox.id, error=repr(e))
    return in_wake


def _agent_error_hint(data: dict[str, Any]) -> str | None:
    """What the developer of an agent whose code raised reads next to the error: the line of their code that raised
    it (the guest finds it in the traceback) and what to do."""
    said = data.get("hint")  # the guest's own fix for what the agent did (a reply that is not JSON, or too big)
    if isinstance(said, str) and said:
        return said[:500]
    where = data.get("where")
    if isinstance(where, str) and where:
        # A host's refusal (or a step that failed on one) carries its own fix in the message: it is not the code's.
        fix = ("the error says what to change" if data.get("type") in ("HostError", "StepFailed")
               else "fix the agent's code and deploy it again")
        return f"raised at {where[:500]} ({fix})"
    detail = data.get("traceback")  # a guest that does not say where: the traceback's last line, as before
    return detail.strip().splitlines()[-1] if isinstance(detail, str) and detail.strip() else None
