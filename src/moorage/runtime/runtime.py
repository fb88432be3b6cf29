"""The runtime facade: deploy agents, run a user's turn in that user's sandbox, resume waiting workflows.

Every public method takes the caller's ``Principal``; the tenant comes from it and nowhere else. Each turn
is a durable workflow run keyed by its turn id, so a retried request replays instead of acting twice. The turns
are here; deployments (``deployments.py``), the operator verbs on an instance (``operator_verbs.py``), a turn's run
in its sandbox (``turn_execution.py``) and the memory tiers (``turn_memory.py``) are parts of the same class.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from typing import Any, AsyncIterator

from moorage.config import Config
from moorage.durable import DurableEngine, NonDeterminismError
from moorage.errors import ConflictError, InvalidInput, MoorageError, NotFound, Unauthenticated
from moorage.lifecycle.manager import InstanceManager
from moorage.llm.gateway import LLMGateway
from moorage.log import get_logger
from moorage.observability import current_trace_id
from moorage.runtime.activity import TenantActivity
from moorage.runtime.host_calls import TurnBinding
from moorage.lifecycle.config import AgentLifecycle
from moorage.router import Router
from moorage.runtime.agent_delete import AgentDeletion
from moorage.runtime.tenant_delete import TenantDeletion
from moorage.runtime.deployments import Deployments
from moorage.runtime.operator_verbs import OperatorVerbs
from moorage.runtime.private_files import private_dir
from moorage.runtime.spans import Tracer
from moorage.runtime.templates import Templates
from moorage.runtime.turn_execution import TurnExecution
from moorage.runtime.turn_memory import TurnMemory, _Memory
from moorage.runtime.turns import (
    AgentTurnFailed,
    TurnEvent,
    TurnLimited,
    TurnResult,
    _NoEvents,
    _raise_agent_failure,
    _Turn,
    _turn_id,
    _TurnEvents,
)
from moorage.sandbox import SandboxDriver, TemplateRef
from moorage.store import Agent, EntityKey, Principal, Store, TenantStore
from moorage.store import zero_retention

#: Named here for importers (the API, webhooks, tests): they live in turns.py and spans.py (``_turn_id`` too).
__all__ = ["AgentTurnFailed", "Runtime", "Tracer", "TurnEvent", "TurnLimited", "TurnResult"]

log = get_logger(__name__)


def _unheard(task: "asyncio.Task[Any]") -> None:
    """The end of a turn nobody listens to any more: a cancellation or a refusal is in its run already; anything else
    is logged, once."""
    if task.cancelled():
        return
    e = task.exception()
    if e is not None and not isinstance(e, MoorageError):
        log.warning("a turn whose caller had left failed", task=task.get_name(), error=f"{type(e).__name__}: {e}")


class Runtime(Deployments, AgentDeletion, TenantDeletion, OperatorVerbs, TurnExecution, TurnMemory):
    def __init__(self, config: Config, store: Store, driver: SandboxDriver, llm: LLMGateway,
                 instances: InstanceManager, *, embedder: Any = None) -> None:
        self.config = config
        self.store = store
        self.driver = driver
        self.llm = llm
        self.instances = instances
        self.embedder = embedder
        self.packages = config.data_dir / "packages"
        private_dir(self.packages)
        from moorage.objects import open_package_blobs

        self.templates = Templates(config.data_dir / "templates", driver, self.packages, open_package_blobs(config))
        self.templates.on_retired = self._retired  # a collected template's warm pool goes with it
        self.turns: dict[str, TurnBinding] = {}
        #: (tenant, trace id) of requests whose credential was revoked under way -> until when a turn of theirs
        #: still queued is refused as it is admitted (``end_request_turns``).
        self._ended_requests: dict[tuple[str, str], float] = {}
        self.activity = TenantActivity()  # which tenants run turns: their CPU shares apply while others do
        self.tracer = Tracer()
        from moorage.memory.embed_queue import EmbedQueue

        #: Embeds turns' messages after their replies went out (they are committed without a vector).
        self.embed_queue = EmbedQueue()
        #: Working memory of turns in progress (turn id -> state, version read): written with the turn's result.
        self._working: dict[str, tuple[Any, int]] = {}
        self._memories: dict[str, _Memory] = {}
        self.backing_up = False  # runtime/tenant_delete.py: an online backup and a tenant delete exclude each other
        self.deleting_tenants: set[str] = set()
        self._loaded: dict[str, str] = {}  # sandbox id -> deployment id loaded in it (this process's view)
        #: Set as the host's stop begins (``Host.stopping``): answers with no end of their own (an agent app's
        #: event stream) end then, rather than hold the server's graceful stop.
        self.stopping = asyncio.Event()
        # Turn ordering per session, concurrency per instance, backpressure and placement live in the router.
        self.router = Router(store, instances, self._forward_turn, self._template_for, admit=self._admit_turn,
                             max_user_pending=config.user_max_turns)
        self.rng = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        from moorage.runtime.mcp_tools import McpTools

        #: Connections to external MCP servers the agents use (credentials stay here, on the host).
        self.mcp = McpTools(self)
        from moorage.timetravel import TimeTravel

        #: Checkpoints of whole instances (sandbox and store state together), rollback and fork.
        self.timetravel = TimeTravel(self)
        instances.settle = self.timetravel.settled_scope  # a requested sleep waits for a checkpoint after a reply
        instances.forgotten = lambda sandbox_id: self._loaded.pop(sandbox_id, None)  # a deleted instance's entry

    async def settle_background(self) -> None:
        """Let the runtime's own background work end while the driver, the instances and the store it uses are
        still open: turns whose reply went out and whose automatic checkpoint runs on (waited for, cancelled past a
        bound), then the embedding of turns' messages (drained, then stopped). The host calls this before closing
        those; callable again."""
        await self.timetravel.close()
        # After the tails: each ending turn submits its messages to the queue.
        await asyncio.to_thread(self.embed_queue.close)

    async def aclose(self) -> None:
        """Close outside connections (MCP servers, model providers) after the background work ended
        (``settle_background``); instances and the store are the host's."""
        await self.settle_background()
        await self.mcp.close()
        with contextlib.suppress(Exception):
            await self.llm.aclose()

    # -- turns --------------------------------------------------------------------------------------

    async def invoke(self, principal: Principal, entity: EntityKey, message: str, *,
                     idempotency_key: str | None = None) -> TurnResult:
        result: TurnResult | None = None
        async for ev in self.stream(principal, entity, message, idempotency_key=idempotency_key, events=False):
            if ev.kind == "done":
                result = ev.data
        assert result is not None
        return result

    async def stream(self, principal: Principal, entity: EntityKey, message: str, *,
                     idempotency_key: str | None = None, events: bool = True) -> AsyncIterator[TurnEvent]:
        """Run one turn; yields streamed events (none with ``events=False``) and finally ``done`` with the
        ``TurnResult``."""
        self.router.check_principal(principal, entity)
        if not isinstance(message, str) or not message.strip():
            raise InvalidInput("the message is empty")
        if len(message.encode()) > 64 * 1024:
            raise InvalidInput("the message is over 64 KiB", hint="send large inputs as files")
        ts = self.store.tenant(principal)
        # Unknown agent or user: a clear 404 before anything is written (no orphan run, no sandbox).
        agent, _, _ = await asyncio.to_thread(self.router.resolve, ts, EntityKey(entity.agent, entity.user, "default"))
        if agent.live_deployment is None:
            raise NotFound(f"agent {entity.agent!r} has no live deployment", hint="deploy it with `moorage deploy`")
        # The user this turn was accepted for: one forgotten (and perhaps made again) before it runs is not them.
        user_since = getattr(await asyncio.to_thread(ts.agent_users.find, entity.agent, entity.user), "created_at", None)
        entity = EntityKey(entity.agent, entity.user, entity.session or "default", entity.workflow)
        turn_id = _turn_id(principal, entity, idempotency_key)
        # A retried request (same Idempotency-Key) finds the first one's run. A new turn's run is created by
        # the turn's first commit, once the router has placed it (a refused turn leaves nothing behind).
        run = await asyncio.to_thread(self._existing_run, ts, turn_id)
        if run is not None:
            asked = run.input or {}
            if asked.get("message") != message or (asked.get("session") or "default") != entity.session:
                raise InvalidInput("this Idempotency-Key was used with a different request",
                                   hint="use a new key for a new turn")
            if run.status in ("succeeded", "waiting"):
                yield TurnEvent("done", await asyncio.to_thread(self._result_of, ts, run))
                return
            _raise_agent_failure(run)
            if run.status in ("running", "pending") and turn_id in self.turns:
                raise ConflictError("this turn is already running", hint="retry later with the same Idempotency-Key")
        async for ev in self._run(ts, agent, entity, turn_id, message, resume=False, principal=principal,
                                  create=run is None, events=events, user_since=user_since):
            yield ev

    async def _admit_turn(self, ts: TenantStore, entity: EntityKey, turn: Any) -> None:
        """The router's last check of a new turn as it gets its instance: its user's caps and the tenant's model
        budget again. Checked only as they arrived, N turns sent at once (or N async turns) all passed before
        any of them ran, and each then ran: a cap was overshot N times over. A resumed turn (an answer, a
        restart) was admitted when it began."""
        if getattr(turn, "resume", False):
            return
        if self._ended_requests.get((ts.tenant_id, getattr(turn, "trace_id", "")), 0.0) > time.monotonic():
            raise Unauthenticated("the credential of this turn's request was revoked before the turn began",
                                  hint="send the turn again with a valid credential")
        from moorage.runtime.revoked_work import RevokedWork

        refused = RevokedWork.of(self).refusal(ts.tenant_id, getattr(turn, "turn_id", ""))
        if refused is not None:  # an async turn whose key was revoked while it waited for its instance
            raise refused
        from moorage.usage import caps

        budget = caps.tenant_token_budget(self, ts.tenant_id)

        def check() -> None:
            if budget is not None:
                caps.check_tenant_budget(ts, budget)
            caps.check(ts, entity.agent, entity.user)

        await asyncio.to_thread(check)

    #: How long a revoked request's turn still queued is refused as it is admitted (past a turn's 600 s at most).
    ENDED_REQUEST_S = 900.0

    async def end_request_turns(self, tenant_id: str, trace_id: str, why: str) -> list[str]:
        """Cancel the turns of a request (its trace id) whose credential was revoked while it was open: those
        running here now, and one still queued is refused as it is admitted (``_admit_turn``). The run ids
        cancelled. A caller that merely leaves does not cancel its turn (it is durable); a revocation does."""
        now = time.monotonic()
        for k, until in list(self._ended_requests.items()):
            if until <= now:
                self._ended_requests.pop(k, None)
        self._ended_requests[(tenant_id, trace_id)] = now + self.ENDED_REQUEST_S
        cancelled: list[str] = []
        for _ in range(3):  # a turn admitted just before is bound to its run a moment later
            for b in [b for b in self.turns.values() if b.ts.tenant_id == tenant_id and b.trace_id == trace_id]:
                if b.run_id in cancelled:
                    continue
                try:
                    run = await asyncio.to_thread(DurableEngine(b.ts).cancel, b.run_id, why)
                except NotFound:
                    continue
                if run.status == "cancelled":
                    cancelled.append(b.run_id)
                    if b.reader is not None:
                        b.reader.cancel()  # the agent stops in the guest now, not at its next journal write
            await asyncio.sleep(0.2)
        return cancelled

    @staticmethod
    def _existing_run(ts: TenantStore, run_id: str) -> Any:
        try:
            return ts.runs.get(run_id)
        except NotFound:
            return None

    async def answer(self, principal: Principal, run_id: str, answer: Any) -> TurnResult:
        """Give a waiting workflow its human answer and resume it from the interrupt."""
        principal.require("invoke")
        ts = self.store.tenant(principal)
        run = await asyncio.to_thread(ts.runs.get, run_id)
        entity = EntityKey(run.scope.agent, run.scope.user or "", (run.input or {}).get("session") or "default")
        self.router.check_principal(principal, entity)  # before anything about the run is said
        if run.status != "waiting":
            raise ConflictError(f"workflow {run_id} is {run.status}, not waiting for an answer",
                                hint=f"only a waiting run takes an answer; GET /v1/workflows/{run_id} shows where it is")
        await DurableEngine(ts).answer(run_id, answer, resume=False)
        agent = await asyncio.to_thread(ts.agents.get, entity.agent)
        result = None
        async for ev in self._run(ts, agent, entity, run_id, (run.input or {}).get("message", ""), resume=True,
                                  principal=principal):
            if ev.kind == "done":
                result = ev.data
        assert result is not None
        return result

    async def cancel(self, principal: Principal, run_id: str) -> None:
        principal.require("invoke")
        ts = self.store.tenant(principal)
        run = ts.runs.get(run_id)
        if run.status in ("succeeded", "failed", "cancelled"):
            raise ConflictError(f"workflow {run_id} already {run.status}")
        run = DurableEngine(ts).cancel(run_id)
        if run.status != "cancelled":  # it finished meanwhile (an answer resumed it first): not cancelled
            raise ConflictError(f"workflow {run_id} already {run.status}")
        binding = self.turns.get(run_id)
        if binding is not None and binding.reader is not None:
            binding.reader.cancel()  # the agent's turn is cancelled in the guest now, not at its next journal write

    async def recover(self) -> int:
        """Finish turns a crashed host left running: each resumes, its journaled steps replay, nothing re-runs."""
        resumed = 0
        # A rollback or fork a killed host left half done is finished first: turns then see one point in time.
        await self.timetravel.recover()
        tenants = await asyncio.to_thread(lambda: list(self.store.operator.tenants()))
        still_building: list[str] = []
        for ts in tenants:  # deploys a crash (of this host, or in a fleet of another) cut short: failed
            building = await asyncio.to_thread(ts.deployments.building)
            if building:
                settled = await asyncio.to_thread(self.settle_builds, ts, building, at_start=True)
                still_building += [d.id for d in settled if d.status == "building"]
        await self.templates.drop_builders(still_building)  # and their builder sandboxes
        for ts in tenants:  # messages a killed host committed but did not embed: embedded in the background
            self.embed_queue.submit(self.memory(ts).episodic)
        for ts in tenants:
            runs = await asyncio.to_thread(ts.runs.list, status=["running", "pending"], limit=10_000)
            for run in runs:
                if run.name != "turn" or run.id in self.turns or run.scope.user is None:
                    continue
                entity = EntityKey(run.scope.agent, run.scope.user, (run.input or {}).get("session") or "default")
                try:
                    agent = await asyncio.to_thread(ts.agents.get, entity.agent)
                    from moorage.runtime.revoked_work import RevokedWork

                    RevokedWork.of(self).watch()  # an async turn's key revoked meanwhile cancels it
                    async for _ in self._run(ts, agent, entity, run.id, (run.input or {}).get("message", ""), resume=True,
                                             events=False):
                        pass
                    resumed += 1
                except Exception as e:  # one broken run must not stop the others from finishing
                    log.warning("could not resume turn", run=run.id, error=str(e))
        return resumed

    @staticmethod
    def _result_of(ts: TenantStore, run: Any) -> TurnResult:
        if run.status == "waiting":
            return TurnResult(run.id, "waiting", None, (run.input or {}).get("trace_id", ""),
                              DurableEngine(ts).waiting_for(run.id), run.id, replayed=True)
        r = run.result or {}
        return TurnResult(run.id, "done", r.get("reply"), r.get("trace_id", ""), None, run.id, r.get("usage"),
                          replayed=True)

    async def _retired(self, template_id: str) -> None:
        """The collection dropped a replaced deployment's template from this host: its warm pool goes too."""
        if self.instances.pool is not None:
            await self.instances.pool.drain(template_id)

    async def _template_for(self, ts: TenantStore, agent: Agent) -> TemplateRef:
        if agent.live_deployment is None:
            raise NotFound(f"agent {agent.name!r} has no live deployment", hint="deploy it with `moorage deploy`")
        ref = await self.templates.ensure(await asyncio.to_thread(ts.deployments.get, agent.live_deployment))
        if self.instances.pool is not None:
            self.instances.pool.want(ref, AgentLifecycle.of(agent).pool)
        return ref

    async def _run(self, ts: TenantStore, agent: Agent, entity: EntityKey, turn_id: str, message: str, *,
                   resume: bool, principal: Principal | None = None, create: bool = False,
                   events: bool = True, user_since: float | None = None) -> AsyncIterator[TurnEvent]:
        """Route the turn (ordering, wake, backpressure) and stream its events; ends with ``done``."""
        if AgentLifecycle.of(agent).scope == "workflow":
            entity = EntityKey(entity.agent, entity.user, entity.session, workflow=turn_id)
        turn = _Turn(ts, entity, turn_id, message, resume, current_trace_id() or uuid.uuid4().hex, create,
                     events=_TurnEvents() if events else _NoEvents())
        if not zero_retention.is_zero(agent):  # (a zero-retention turn is purged once it has wholly ended)
            turn.answered = asyncio.get_running_loop().create_future()
        who = principal or self.store.operator.principal(ts.tenant_id)
        task = asyncio.create_task(self.router.route(who, entity, turn, user_since=user_since), name=f"turn-{turn_id}")
        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                while not turn.events.empty():  # events that came together go out without a wait each
                    yield turn.events.get_nowait()
                getter = asyncio.ensure_future(turn.events.get())
                done, _ = await asyncio.wait({getter, task} | ({turn.answered} if turn.answered else set()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not turn.events.empty():
                    yield turn.events.get_nowait()
                if turn.answered is not None and turn.answered.done() and not task.done():
                    # The reply goes out now; the turn's automatic checkpoint runs on, still holding the instance.
                    self.timetravel.keep_tail(task)
                    yield TurnEvent("done", turn.answered.result())
                    return
                if task.exception() is not None and not isinstance(task.exception(), NonDeterminismError):
                    # Refused before it started (busy, overloaded, no capacity): the run must not linger as pending.
                    # (A run whose replay diverged is pending on purpose: left for a corrected deployment.)
                    await asyncio.to_thread(self._abandon, ts, turn_id, task.exception())
                if zero_retention.is_zero(agent) and (task.exception() is not None or task.result().status != "waiting"):
                    # The agent keeps nothing of a turn once it ended (a waiting one keeps its run until answered).
                    try:
                        await asyncio.to_thread(zero_retention.purge, ts, entity.agent, entity.user)
                    except Exception as e:  # noqa: BLE001 - the answer still goes out; the host's sweep purges later
                        log.error("zero-retention purge failed", agent=entity.agent, error=str(e))
                    self.drop_cached_vectors(ts, entity.agent, entity.user)
                # The turn itself is durable: a caller that stops listening does not cancel it.
                yield TurnEvent("done", task.result())
                return
        finally:
            # The caller stopped listening (its stream closed, its request ended): the turn runs on, durable, and
            # how it ends is kept in its run. Its task's end is taken here, so a turn cancelled after that (a forget,
            # a revoked key) is not reported by asyncio as "Task exception was never retrieved", and the wait on its
            # events is let go, not left pending.
            if getter is not None and not getter.done():
                getter.cancel()
            if not task.done():
                task.add_done_callback(_unheard)
            elif not task.cancelled():
                task.exception()  # taken: the caller had its result, or left as it came

    @staticmethod
    def _abandon(ts: TenantStore, run_id: str, error: BaseException) -> None:
        try:
            run = ts.runs.get(run_id)
        except NotFound:  # a new turn refused before its first commit: nothing to clean up
            return
        if run.status == "pending":
            with contextlib.suppress(ConflictError):
                ts.runs.update(run_id, expected_version=run.version, status="failed", error=f"not started: {error}")
