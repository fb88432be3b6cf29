"""The runtime facade: deploy agents, run a user's turn in that user's sandbox, resume waiting workflows.

Every public method takes the caller's ``Principal``; the tenant comes from it and nowhere else. Each turn
is a durable workflow run keyed by its turn id, so a retried request replays instead of acting twice. The turns
are here; deployments (``deployments.py``) and the operator verbs on an instance (``operator_verbs.py``) are parts
of the same class.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from moorage.config import Config
from moorage.durable import DurableEngine, NonDeterminismError
from moorage.errors import ConflictError, InvalidInput, MoorageError, NotFound
from moorage.lifecycle.manager import InstanceManager
from moorage.llm.gateway import LLMGateway
from moorage.log import get_logger
from moorage.observability import current_trace_id
from moorage.runtime.activity import TenantActivity
from moorage.runtime.host_calls import GuestCalls, TurnBinding
from moorage.lifecycle.config import AgentLifecycle
from moorage.router import Router
from moorage.runtime import instance_update
from moorage.runtime.deployments import Deployments
from moorage.runtime.operator_verbs import OperatorVerbs
from moorage.runtime.private_files import private_dir
from moorage.runtime.templates import Templates
from moorage.sandbox import RemoteError, Sandbox, SandboxDriver, TemplateRef
from moorage.store import DEPLOYMENT_FAILED, Agent, EntityKey, EventIn, Principal, Scope, Span, Store, TenantStore
from moorage.store import zero_retention

log = get_logger(__name__)

#: The guest runtime's error code for "that deployment is not loaded here" (see guest/agent.py).
NOT_LOADED = -32010


@dataclass(frozen=True)
class TurnResult:
    turn_id: str
    status: str  # done | waiting
    reply: Any
    trace_id: str
    interrupt: Any = None
    run_id: str | None = None
    #: Model tokens this execution of the turn used (``input_tokens``, ``output_tokens``).
    usage: dict[str, int] | None = None
    #: The answer of an earlier request with the same Idempotency-Key: nothing ran now.
    replayed: bool = False


@dataclass(frozen=True)
class TurnEvent:
    kind: str  # token | tool | event | done | error
    data: Any


class AgentTurnFailed(InvalidInput):
    """The agent's own code raised during a turn; the message carries its error for the developer. The run is
    settled as failed with it: the same turn asked again (same Idempotency-Key) answers this again, not run twice."""

    code = "agent-error"
    http_status = 502
    for_caller = True
    retryable = False


class TurnLimited(MoorageError):
    """A limit on the agent's own host call (the tenant's model rate or token budget) ended the turn: answered
    as that limit (429, with when to come back), not as the agent's failure, and a retry later runs it again."""

    http_status = 429
    for_caller = True

    def __init__(self, message: str, *, code: str, retry_after: float | None, hint: str | None) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.retry_after = retry_after


#: Kinds of host-call refusal that are limits, not failures (``TurnLimited``).
_LIMIT_KINDS = frozenset({"rate-limited", "budget-exceeded"})


def _raise_agent_failure(run: Any) -> None:
    """A turn asked again (same Idempotency-Key) whose run the agent's own code failed: that failure again. One
    that failed for another reason (its sandbox stopped, the host went away) runs again; its journaled steps
    replay."""
    failure = (run.result or {}).get("failure") if run.status == "failed" and isinstance(run.result, dict) else None
    if isinstance(failure, dict) and failure.get("code") == AgentTurnFailed.code:
        raise AgentTurnFailed(str(failure.get("message") or run.error or "the agent failed"), hint=failure.get("hint"))


class _TurnEvents(asyncio.Queue):  # type: ignore[type-arg]
    """A turn's streamed events, bounded: the turn runs on when nobody reads (it is durable), so once full the
    oldest unread event gives way to the newest (the result never travels here) and ``dropped`` counts them."""

    LIMIT = 1024

    def __init__(self) -> None:
        super().__init__(maxsize=self.LIMIT)
        self.dropped = 0

    def put_nowait(self, item: Any) -> None:
        if self.full():
            self.get_nowait()
            self.dropped += 1
        super().put_nowait(item)


class _NoEvents(_TurnEvents):
    """A turn whose caller wants only its result (``invoke``): streamed events are counted and dropped as they come,
    so a guest that streams a flood costs the host its frames' decoding and nothing per event after that."""

    def put_nowait(self, item: Any) -> None:
        self.dropped += 1


@dataclass
class _Turn:
    """One turn on its way through the router to a sandbox; streamed events flow back through ``events``."""

    ts: TenantStore
    entity: EntityKey
    turn_id: str
    message: str
    resume: bool
    trace_id: str
    #: No run exists yet: the turn's first commit creates it (a retried request finds it from then on).
    create: bool = False
    events: asyncio.Queue = field(default_factory=_TurnEvents)
    #: Set with the turn's result as soon as its reply may go out, before the automatic checkpoint that still
    #: holds the instance (time travel); None: the reply goes out when the whole turn has ended.
    answered: asyncio.Future | None = None


@dataclass
class _Memory:
    episodic: Any
    semantic: Any


class Tracer:
    """Records spans of guest calls and turns into the tenant's own store (tenant-scoped trace reads).

    Spans of a turn in progress are held and written with the turn's last commit (``flush``), so tracing adds
    no commit of its own to a turn; a host killed mid-turn loses that turn's spans, never its journal.
    """

    #: Spans one turn holds at most; past it they are written in a commit of their own, off the event loop.
    BUFFER = 256
    #: Spans one turn records at most: a guest that makes thousands of calls in a turn costs its store, and the
    #: host's commits, no more than this; the rest are counted and logged once per turn.
    MAX_PER_TURN = 2048

    def __init__(self) -> None:
        self._held: dict[str, list[Span]] = {}
        self._counts: dict[str, int] = {}
        self._writes: set[asyncio.Future[None]] = set()
        #: Where each span is also exported as it ends (``otlp_endpoint``); None: the store only.
        self.sink: Any = None

    def open(self, turn_id: str) -> None:
        """Hold the spans of ``turn_id`` until ``flush``."""
        self._held.setdefault(turn_id, [])

    def close(self, turn_id: str) -> None:
        """Stop holding spans of ``turn_id``; any not flushed are dropped."""
        self._held.pop(turn_id, None)
        self._done(turn_id)

    def _done(self, turn_id: str) -> None:
        dropped = self._counts.pop(turn_id, 0) - self.MAX_PER_TURN
        if dropped > 0:
            log.warning("spans of a turn over its limit were not recorded", turn=turn_id, dropped=dropped)

    def span(self, b: TurnBinding, name: str, started_perf: float, status: str = "ok", **attrs: Any) -> None:
        if b.turn_id in self._held:
            count = self._counts[b.turn_id] = self._counts.get(b.turn_id, 0) + 1
            if count > self.MAX_PER_TURN:
                return
        end = time.time()
        start = end - (time.perf_counter() - started_perf)
        span = Span(b.trace_id, uuid.uuid4().hex[:16], None, name, start, end, status,
                    {"agent": b.entity.agent, "user": b.entity.user, "session": b.entity.session, **attrs},
                    b.session_scope)
        if self.sink is not None:
            try:
                self.sink.export(b.ts.tenant_id, span)
            except Exception as e:  # noqa: BLE001 - exporting never breaks a turn
                log.warning("span not exported", error=str(e))
        held = self._held.get(b.turn_id)
        if held is not None:
            held.append(span)
            if len(held) < self.BUFFER:
                return
            spans, held[:] = list(held), []
        else:
            spans = [span]

        def write() -> None:
            try:
                with b.ts.transaction():
                    for sp in spans:
                        b.ts.spans.record(sp)
            except Exception as e:  # tracing never breaks a turn
                log.warning("span not recorded", error=str(e))

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called from a worker thread: write here
            write()
            return
        # A commit (an fsync) never runs on the host's one event loop, which every tenant's turns share.
        fut = loop.run_in_executor(None, write)
        self._writes.add(fut)
        fut.add_done_callback(self._writes.discard)

    def flush(self, b: TurnBinding) -> None:
        """Write the spans held for ``b``'s turn, inside the caller's transaction; later spans are written at once."""
        for sp in self._held.pop(b.turn_id, []):
            b.ts.spans.record(sp)
        self._done(b.turn_id)


def _turn_id(principal: Principal, entity: EntityKey, idempotency_key: str | None) -> str:
    if idempotency_key is None:
        return uuid.uuid4().hex
    if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= 200:
        raise InvalidInput("Idempotency-Key must be 1-200 characters")
    # Same key, same entity → same turn: a retried request finds the first one's result.
    h = hashlib.sha256(f"{principal.tenant_id}/{entity.agent}/{entity.user}/{idempotency_key}".encode()).hexdigest()
    return h[:32]


class Runtime(Deployments, OperatorVerbs):
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
        self.turns: dict[str, TurnBinding] = {}
        self.activity = TenantActivity()  # which tenants run turns: their CPU shares apply while others do
        self.tracer = Tracer()
        from moorage.memory.embed_queue import EmbedQueue

        #: Embeds turns' messages after their replies went out (they are committed without a vector).
        self.embed_queue = EmbedQueue()
        #: Working memory of turns in progress (turn id -> state, version read): written with the turn's result.
        self._working: dict[str, tuple[Any, int]] = {}
        self._memories: dict[str, _Memory] = {}
        self._loaded: dict[str, str] = {}  # sandbox id -> deployment id loaded in it (this process's view)
        # Turn ordering per session, concurrency per instance, backpressure and placement live in the router.
        self.router = Router(store, instances, self._forward_turn, self._template_for)
        self.rng = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        from moorage.runtime.mcp_tools import McpTools

        #: Connections to external MCP servers the agents use (credentials stay here, on the host).
        self.mcp = McpTools(self)
        from moorage.timetravel import TimeTravel

        #: Checkpoints of whole instances (sandbox and store state together), rollback and fork.
        self.timetravel = TimeTravel(self)
        instances.settle = self.timetravel.settled_scope  # a requested sleep waits for a checkpoint after a reply

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

    # -- memory tiers per tenant --------------------------------------------------------------------

    def memory(self, ts: TenantStore) -> _Memory:
        m = self._memories.get(ts.tenant_id)
        if m is None:
            from moorage.memory import EpisodicMemory, SemanticMemory, default_embedder

            extractor = None
            if self.config.memory_extractor == "model":
                from moorage.memory.llm_backed import GatewayFactExtractor

                extractor = GatewayFactExtractor(self.llm, ts.tenant_id, lambda: self._loop)
            m = self._memories[ts.tenant_id] = _Memory(EpisodicMemory(ts, self.embedder or default_embedder()),
                                                        SemanticMemory(ts, extractor))
        return m

    def _writer(self, ts: TenantStore) -> _Memory:
        """The tenant's memory tiers bound to ``ts`` itself, so their writes join a transaction open on it."""
        from moorage.memory import EpisodicMemory, SemanticMemory

        m = self.memory(ts)
        return _Memory(EpisodicMemory(ts, m.episodic.embedder), SemanticMemory(ts, m.semantic.extractor))

    def _summarizer(self, b: TurnBinding) -> Any:
        if self.config.memory_summarizer != "model":
            return None  # the context builder's offline extractive summarizer
        from moorage.memory.llm_backed import GatewaySummarizer

        return GatewaySummarizer(self.llm, b.ts.tenant_id, lambda: self._loop,
                                 entity={"agent": b.entity.agent, "user": b.entity.user})

    def working_memory_input(self, b: TurnBinding, message: str, system: str, tools: list[dict[str, Any]]) -> list[dict[str, str]]:
        """Model input for this turn from the session's context builder (stable prefix + append-only tail).

        The updated builder is kept with the turn and written with its result (``_save_working_memory``): a
        turn that never finishes leaves working memory as it was, so its retry adds the message once.
        """
        from moorage.memory import ContextBuilder

        scope = b.session_scope
        builder = ContextBuilder(system or "", tools, summarizer=self._summarizer(b))
        held = self._working.get(b.turn_id)
        if held is not None:
            builder.restore(held[0])
            version = held[1]
        else:
            rec = b.ts.state.get(scope, "working_memory")
            if rec is not None:
                builder.restore(rec.value)
            version = rec.version if rec else 0
        facts = self.memory(b.ts).semantic.recall(b.user_scope)
        note = "; ".join(f.text or f"{f.subject} {f.attribute}: {f.value}" for f in facts[-12:])
        # Known facts ride in the new user turn, never in the prefix, so the prefix stays byte-identical.
        builder.add("user", f"[known about the user: {note}]\n{message}" if note else message)
        out = builder.build()
        self._working[b.turn_id] = (builder.to_state(), version)
        return [m if isinstance(m, dict) else m.to_dict() for m in out.messages]

    def _remember_reply(self, b: TurnBinding, reply: Any) -> None:
        """Write the turn's working memory with the reply appended (inside the turn's last transaction)."""
        from moorage.memory import ContextBuilder

        held = self._working.pop(b.turn_id, None)
        if held is None:
            rec = b.ts.state.get(b.session_scope, "working_memory")
            if rec is None or not isinstance(reply, str):
                return
            held = (rec.value, rec.version)
        builder = ContextBuilder("", [])
        builder.restore(held[0])
        if isinstance(reply, str):
            builder.add("assistant", reply)
        b.ts.state.put(b.session_scope, "working_memory", builder.to_state(), expected_version=held[1])

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
                                  create=run is None, events=events):
            yield ev

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
        DurableEngine(ts).cancel(run_id)

    async def recover(self) -> int:
        """Finish turns a crashed host left running: each resumes, its journaled steps replay, nothing re-runs."""
        resumed = 0
        # A rollback or fork a killed host left half done is finished first: turns then see one point in time.
        await self.timetravel.recover()
        tenants = await asyncio.to_thread(lambda: list(self.store.operator.tenants()))
        if self.instances.fleet is None:  # one host per store: a deploy still building died with its last process
            for ts in tenants:
                for d in await asyncio.to_thread(ts.deployments.building):
                    log.warning("a deploy was cut short by the host stopping; marked failed (deploy again)",
                                tenant=ts.tenant_id, deployment=d.id, number=d.number)
                    await asyncio.to_thread(ts.deployments.set_status, d.id, DEPLOYMENT_FAILED)
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

    async def _template_for(self, ts: TenantStore, agent: Agent) -> TemplateRef:
        if agent.live_deployment is None:
            raise NotFound(f"agent {agent.name!r} has no live deployment", hint="deploy it with `moorage deploy`")
        ref = await self.templates.ensure(await asyncio.to_thread(ts.deployments.get, agent.live_deployment))
        if self.instances.pool is not None:
            self.instances.pool.want(ref, AgentLifecycle.of(agent).pool)
        return ref

    async def _run(self, ts: TenantStore, agent: Agent, entity: EntityKey, turn_id: str, message: str, *,
                   resume: bool, principal: Principal | None = None, create: bool = False,
                   events: bool = True) -> AsyncIterator[TurnEvent]:
        """Route the turn (ordering, wake, backpressure) and stream its events; ends with ``done``."""
        if AgentLifecycle.of(agent).scope == "workflow":
            entity = EntityKey(entity.agent, entity.user, entity.session, workflow=turn_id)
        turn = _Turn(ts, entity, turn_id, message, resume, current_trace_id() or uuid.uuid4().hex, create,
                     events=_TurnEvents() if events else _NoEvents())
        if not zero_retention.is_zero(agent):  # (a zero-retention turn is purged once it has wholly ended)
            turn.answered = asyncio.get_running_loop().create_future()
        who = principal or self.store.operator.principal(ts.tenant_id)
        task = asyncio.create_task(self.router.route(who, entity, turn), name=f"turn-{turn_id}")
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

    def drop_cached_vectors(self, ts: TenantStore, agent: str, user: str | None = None) -> None:
        """After a purge: the episodic cache of the user's (or every user's) scopes of ``agent`` is stale in a
        way its event count may not show."""
        m = self._memories.get(ts.tenant_id)
        if m is not None:
            if user is None:
                m.episodic.drop_cached(lambda key: key.startswith((f"user:{agent}/", f"session:{agent}/")))
            else:
                m.episodic.drop_cached(lambda key: key == f"user:{agent}/{user}" or key.startswith(f"session:{agent}/{user}/"))

    @staticmethod
    def _abandon(ts: TenantStore, run_id: str, error: BaseException) -> None:
        try:
            run = ts.runs.get(run_id)
        except NotFound:  # a new turn refused before its first commit: nothing to clean up
            return
        if run.status == "pending":
            with contextlib.suppress(ConflictError):
                ts.runs.update(run_id, expected_version=run.version, status="failed", error=f"not started: {error}")

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
        try:
            out: dict[str, Any] = {}
            try:
                async for item in self.forward(sandbox, binding, turn.message):
                    if isinstance(item, TurnEvent):
                        if item.kind == "tool":  # a tool the agent ran in its sandbox: traced like host calls
                            tool = (item.data.get("data") or {}).get("name") if isinstance(item.data, dict) else None
                            self.tracer.span(binding, "tool", time.perf_counter(), tool=str(tool))
                        turn.events.put_nowait(item)
                    else:
                        out = item
            except Exception as e:
                if binding.diverged is not None:
                    # Replayed code that asked for other steps than the journal holds: the run is left pending for
                    # a corrected deployment (the same turn asked again, or the host's next start, resumes it).
                    await asyncio.to_thread(self._end_turn, engine, binding, started, diverged=binding.diverged)
                    raise binding.diverged from e
                await asyncio.to_thread(self._end_turn, engine, binding, started, error=e)
                raise
            if out.get("status") == "waiting":  # the engine already set the run waiting at the interrupt
                await asyncio.to_thread(self._end_turn, engine, binding, started, waiting=True)
                result = TurnResult(turn_id, "waiting", None, turn.trace_id, out.get("interrupt"), turn_id,
                                    dict(binding.usage))
            else:
                reply = out.get("reply")
                await asyncio.to_thread(self._end_turn, engine, binding, started, reply=reply)
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
        from moorage.memory.semantic import origin_of

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
                                            valid_from=ev.ts)
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

    def _end_turn(self, engine: DurableEngine, b: TurnBinding, started: float, *, reply: Any = None,
                  waiting: bool = False, error: BaseException | None = None,
                  diverged: BaseException | None = None) -> None:
        """The turn's last commit, before its reply goes out: the reply logged (to be embedded later), working
        memory, the run's result and the turn's spans, in one transaction. A failed turn records its failure
        and spans; a waiting one (its interrupt is already journaled) only its spans."""
        ts = b.ts
        with ts.transaction():
            self._fence(ts, b.sandbox_id)
            if diverged is not None:
                run = ts.runs.get(b.run_id)
                if run.status == "running":
                    ts.runs.update(b.run_id, expected_version=run.version, status="pending")
                self.tracer.span(b, "turn", started, status="error", error=type(diverged).__name__)
            elif error is not None:
                failure = ({"failure": {"code": error.code, "message": error.message, "hint": error.hint}}
                           if isinstance(error, AgentTurnFailed) else None)
                engine.fail_run(b.run_id, str(error), result=failure)
                self.tracer.span(b, "turn", started, status="error", error=type(error).__name__)
            elif waiting:
                self.tracer.span(b, "turn", started, status="waiting")
            else:
                said = reply if isinstance(reply, str) and reply else None
                if said is not None:
                    self._writer(ts).episodic.remember_pending(b.session_scope, [EventIn("message", said, "assistant")])
                self._remember_reply(b, said)
                engine.finish_run(b.run_id, {"reply": reply, "trace_id": b.trace_id, "usage": dict(b.usage)})
                self.tracer.span(b, "turn", started, status="done")
            self.tracer.flush(b)

    async def forward(self, sandbox: Sandbox, binding: TurnBinding, message: str) -> AsyncIterator[Any]:
        """Send one turn to the agent in ``sandbox``; yields TurnEvents, then the guest's result dict."""
        def register(channel: Any) -> None:
            GuestCalls(self, sandbox.id, binding.ts.tenant_id).register(channel)

        register(sandbox.channel)
        params = {"deployment_id": binding.deployment_id, "turn_id": binding.turn_id, "message": message,
                  "entity": {"agent": binding.entity.agent, "user": binding.entity.user, "session": binding.entity.session}}
        for attempt in (1, 2):
            # A fork of the deployment's template already has its code loaded (the template was snapshotted with
            # it), and so has an instance that ran it before a sleep: the turn is sent straight away, and only a
            # guest that answers NOT_LOADED (a cold boot, a redeploy) gets the code pushed before the second try.
            if self._loaded.get(sandbox.id) not in (None, binding.deployment_id) or attempt == 2:
                dep = await asyncio.to_thread(binding.ts.deployments.get, binding.deployment_id)
                # Its packages made the deployment's first (a redeploy may have changed them: a restart).
                await instance_update.load(self, sandbox, dep, binding.ts, on_restart=register)
            self._loaded[sandbox.id] = binding.deployment_id
            try:
                # Counted while it runs: a redeploy's change of the sandbox waits for it (instance_update.drain).
                with instance_update.in_turn(sandbox.id):
                    async with sandbox.channel.stream("agent.turn", params, timeout=600) as call:
                        async for ev in call:
                            yield TurnEvent("event" if ev.event not in ("token", "tool") else ev.event,
                                            {"event": ev.event, "data": ev.data})
                        result = call.result
                break
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
                detail = data.get("traceback")
                raise AgentTurnFailed(e.message, hint=(detail or "").strip().splitlines()[-1] if detail else None) from e
        yield result
