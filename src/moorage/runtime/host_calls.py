"""What the host serves to a guest over its channel: model calls, memory and durable steps.

Identity is bound here, from the channel and the turn the host itself started, never from the guest's
words: a call names a ``turn_id`` and the host looks up which tenant, agent, user and run it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from moorage.errors import InvalidInput, MoorageError
from moorage.durable import DEFAULT_BACKOFF, Answer, DurableEngine, NonDeterminismError, Replay
from moorage.durable.runlog import earlier_entries
from moorage.llm.types import ChatRequest, Message, ResponseFormat, ToolCall, ToolSpec
from moorage.log import get_logger
from moorage.runtime import cpu_share
from moorage.sandbox.channel import HandlerError
from moorage.store import EntityKey, Scope, TenantStore
from moorage.usage import store_cap, tenant_cap

if TYPE_CHECKING:
    from moorage.runtime.runtime import Runtime

log = get_logger(__name__)

#: Largest model output a guest may ask for in one call.
MAX_TOKENS_CAP = 4096
#: Largest response body handed back to a guest from ``net.fetch`` (read up to this, then cut).
MAX_FETCH_BYTES = 1 << 20


#: What one turn's guest calls may hand the store to keep, at most (their frames' bytes: memories, facts, journal
#: results, a graph's checkpoints). Each value is bounded already, but a loop in the agent's code is not: remembering
#: 256 KiB texts filled the store at 2.5 MiB/s (about 1.5 GB in a 10-minute turn) on every tenant's disk. Past it
#: those calls are refused for the rest of the turn; reads and every other call go on.
STORE_WRITES_PER_TURN = 256 << 20
_STORE_WRITES = frozenset({"memory.append", "memory.learn", "durable.complete", "durable.fail", "durable.interrupt",
                           "durable.correct", "graph.put", "graph.put_writes"})


class TurnStoreLimit(InvalidInput):
    """A turn's calls handed the store more than ``STORE_WRITES_PER_TURN`` to keep."""

    code = "turn-store-limit"


#: Per runtime, per tenant: how many guest-initiated calls may run at once (``Config.guest_calls_per_tenant``).
_SHARES: "weakref.WeakKeyDictionary[Any, dict[str, asyncio.Semaphore]]" = weakref.WeakKeyDictionary()


#: Guest calls whose host work is not charged to the tenant's CPU share.
_UNMETERED = frozenset({"llm.complete"})
_METERS: "weakref.WeakKeyDictionary[Any, dict[str, cpu_share.Meter]]" = weakref.WeakKeyDictionary()


def _tenant_meter(rt: Any, tenant_id: str) -> cpu_share.Meter:
    meters = _METERS.setdefault(rt, {})
    meter = meters.get(tenant_id)
    if meter is None:
        cpu_share.install(asyncio.get_running_loop())
        # The share applies while another tenant's turns run (runtime/activity.py): alone, a tenant has the host.
        activity = getattr(rt, "activity", None)
        meter = meters[tenant_id] = cpu_share.Meter(
            max(0.01, float(rt.config.guest_cpu_share)),
            contended=(lambda: activity.others_active(tenant_id)) if activity is not None else None)
    return meter


def _tenant_share(rt: Any, tenant_id: str) -> asyncio.Semaphore:
    shares = _SHARES.setdefault(rt, {})
    sem = shares.get(tenant_id)
    if sem is None:
        # At most half the workers of the default executor (6 on a 2-core host), or a share of 8 would let one
        # tenant hold every worker and queue every other tenant's store hops behind it.
        workers = cpu_share.executor_workers()
        sem = shares[tenant_id] = asyncio.Semaphore(max(1, min(int(rt.config.guest_calls_per_tenant), workers // 2)))
    return sem


async def _noting_divergence(b: "TurnBinding", call: Awaitable[Any]) -> Any:
    try:
        return await call
    except NonDeterminismError as e:
        b.diverged = e
        raise


@dataclass
class TurnBinding:
    """A turn the host started in one sandbox: the only identity a guest call can act under."""

    turn_id: str
    sandbox_id: str
    ts: TenantStore
    entity: EntityKey
    run_id: str
    deployment_id: str
    manifest: dict[str, Any]
    trace_id: str
    #: The durable engine that owns this turn's run (its step log, journal and interrupts).
    engine: DurableEngine = field(repr=False, default=None)  # type: ignore[assignment]
    #: Set when the agent's replayed code asked for another step than the journal holds: the run is left for a
    #: corrected deployment to resume, not failed.
    diverged: NonDeterminismError | None = field(repr=False, default=None)
    #: Model tokens the turn's calls used so far (what the caller is told with the reply).
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0})
    #: The task reading the agent's answer from the guest; cancelling it cancels the agent's turn in the guest
    #: (a cancel of the run, ``Runtime.cancel``).
    reader: "asyncio.Task[Any] | None" = field(repr=False, default=None)
    #: Bytes this turn's guest calls handed the store to keep so far (``STORE_WRITES_PER_TURN``).
    store_written: int = 0
    #: The user's ``store_mib`` cap (usage/store_cap.py), read at the turn's first call that writes.
    store_cap_mib: float | None = None
    store_cap_read: bool = False
    #: Whether this turn measured its user's store already (a crossing measures once per turn at least).
    store_measured: bool = False

    @property
    def user_scope(self) -> Scope:
        return Scope.for_user(self.entity.agent, self.entity.user)

    @property
    def session_scope(self) -> Scope:
        return Scope.session(self.entity.agent, self.entity.user, self.entity.session or "default")

    def scope(self, name: str) -> Scope:
        if name == "user":
            return self.user_scope
        if name == "session":
            return self.session_scope
        raise InvalidInput(f"unknown memory scope {name!r}", hint="use 'user' or 'session'")


def _to_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("messages must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidInput("each message needs a role of system, user, assistant or tool")
        calls = tuple(ToolCall(str(c.get("id", "")), str(c["name"]), dict(c.get("arguments") or {}))
                      for c in (m.get("tool_calls") or []))
        content = m.get("content") or ""
        out.append(Message(m["role"], content if isinstance(content, str) else str(content), tool_calls=calls,
                           tool_call_id=m.get("tool_call_id"), name=m.get("name")))
    return out


def _to_tools(raw: Any) -> tuple[ToolSpec, ...]:
    if not raw:
        return ()
    return tuple(ToolSpec(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object", "properties": {}})
                 for t in raw)


def egress_of(rt: Any) -> Any:
    """The runtime's egress service (``rt.egress``), made from its config on first use; tests may set their own."""
    eg = getattr(rt, "egress", None)
    if eg is None:
        from moorage.egress import Egress

        eg = rt.egress = Egress.from_config(rt.config)
    return eg


def secrets_of(rt: Any) -> Any:
    """The runtime's secret store (``rt.secrets``, the operator's keys), made from its config on first use."""
    store = getattr(rt, "secrets", None)
    if store is None:
        from moorage.secrets import SecretStore

        store = rt.secrets = SecretStore.from_config(rt.config)
    return store


class GuestCalls:
    """The handlers one sandbox's channel gets. Registered again after every wake (new connection)."""

    def __init__(self, runtime: "Runtime", sandbox_id: str, tenant_id: str) -> None:
        self.rt = runtime
        self.sandbox_id = sandbox_id
        self.tenant_id = tenant_id

    def register(self, channel: Any) -> None:
        for method, fn in self.methods().items():
            channel.register(method, self._wrap(method, fn))
        # The sandbox's cost to the host's event loop (its frames, its calls' steps) is charged to the same share
        # of the host's CPU as its calls' thread work; past it, the channel stops reading the guest.
        channel.share = _tenant_meter(self.rt, self.tenant_id)
        from moorage.runtime.vm_network import attach_from_turn

        attach_from_turn(self.rt, self.sandbox_id, channel)  # the agent's own network, if it declares one

    def methods(self) -> dict[str, Callable[[TurnBinding, dict[str, Any]], Awaitable[Any]]]:
        from moorage.runtime.graph_calls import GraphCalls

        return {
            **GraphCalls().methods(),  # a LangGraph checkpointer's store (runtime/graph_calls.py)
            "llm.complete": self.llm_complete,
            "memory.append": self.memory_append,
            "memory.search": self.memory_search,
            "memory.facts": self.memory_facts,
            "memory.learn": self.memory_learn,
            "memory.context": self.memory_context,
            "durable.begin": self.durable_begin,
            "durable.complete": self.durable_complete,
            "durable.fail": self.durable_fail,
            "durable.interrupt": self.durable_interrupt,
            "durable.history": self.durable_history,
            "durable.correct": self.durable_correct,
            "net.fetch": self.net_fetch,
            "secrets.env": self.secrets_env,
            "mcp.tools": self.mcp_tools,
            "mcp.call": self.mcp_call,
            "timetravel.checkpoint": self.timetravel_checkpoint,
        }

    def _wrap(self, method: str, fn: Callable[[TurnBinding, dict[str, Any]], Awaitable[Any]]) -> Any:
        async def handler(params: Any, ctx: Any) -> Any:
            if not isinstance(params, dict):
                raise HandlerError("params must be an object", code=-32602)
            binding = self.rt.turns.get(str(params.get("turn_id", "")))
            # A guest can only act inside a turn the host started in *this* sandbox.
            if binding is None or binding.sandbox_id != self.sandbox_id:
                log.warning("guest call outside its turns rejected", sandbox=self.sandbox_id, method=method)
                raise HandlerError("no such turn in this sandbox", code=-32000,
                                   data={"type": "TenantScopeError", "kind": "tenant-scope"})
            nbytes = getattr(ctx, "frame_bytes", 0)
            if method in _STORE_WRITES:
                binding.store_written += nbytes
                if binding.store_written > STORE_WRITES_PER_TURN:
                    e = TurnStoreLimit(f"this turn has handed the store {binding.store_written >> 20} MiB to keep "
                                       f"(memories, journal, graph checkpoints), more than one turn may "
                                       f"({STORE_WRITES_PER_TURN >> 20} MiB); {method} refused: keep large data in "
                                       f"files (ctx.files) and their names in memory")
                    raise HandlerError(str(e), code=-32000, data={"type": type(e).__name__, "kind": e.code})
            # The tenant's share of the host (its executor threads, the store): its calls past the share wait here,
            # where waiting costs one coroutine; the channel bounds how many may wait per sandbox.
            async with _tenant_share(self.rt, binding.ts.tenant_id):
                # And its share of the host's CPU: the thread work of the call is charged to it here, its steps on
                # the event loop by the channel, which stops reading the guest once the share is spent (the guest
                # waits; calls already read finish). Model calls' threads are not metered here: the model has its
                # own per-tenant limits (llm/policy.py).
                meter = _tenant_meter(self.rt, binding.ts.tenant_id) if method not in _UNMETERED else None
                started = time.perf_counter()
                try:
                    with cpu_share.metered(meter) if meter is not None else contextlib.nullcontext():
                        if method in _STORE_WRITES:  # and what the user's instance keeps over time: store_mib
                            await store_cap.admit(self.rt, binding, nbytes, method)
                            # ... and what the whole tenant keeps: its storage ceiling
                            kept = nbytes + (store_cap.EMBEDDING_BYTES if method == "memory.append" else 0)
                            await tenant_cap.admit(self.rt.config, binding.ts, kept, method)
                        return await fn(binding, params)
                except MoorageError as e:
                    wait = getattr(e, "retry_after", None) or getattr(e, "resets_in", None)
                    raise HandlerError(str(e), code=-32000,
                                       data={"type": type(e).__name__, "kind": e.code, "hint": e.hint,
                                             **({"retry_after": float(wait)} if wait else {})}) from e
                finally:
                    self.rt.tracer.span(binding, method, started)

        return handler

    # -- model calls --------------------------------------------------------------------------------

    async def llm_complete(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        max_tokens = p.get("max_tokens")
        if max_tokens is not None:
            max_tokens = max(1, min(int(max_tokens), MAX_TOKENS_CAP))
        rf = p.get("response_format")
        req = ChatRequest(
            _to_messages(p.get("messages")), model=str(p.get("model") or ""), tools=_to_tools(p.get("tools")),
            response_format=ResponseFormat(rf["schema"], rf.get("name", "response")) if isinstance(rf, dict) and "schema" in rf else None,
            max_tokens=max_tokens, temperature=p.get("temperature"),
        )
        entity = {"agent": b.entity.agent, "user": b.entity.user, "session": b.entity.session or ""}
        resp = await self.rt.llm.complete(b.ts.tenant_id, req, entity=entity, trace_id=b.trace_id)
        b.usage["input_tokens"] += resp.usage.input_tokens
        b.usage["output_tokens"] += resp.usage.output_tokens
        return {
            "text": resp.text,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in resp.tool_calls],
            "finish_reason": resp.finish_reason,
            # No prompt-cache counts: a guest that saw them could test guesses at prompts it does not know.
            "usage": {"input_tokens": resp.usage.input_tokens, "output_tokens": resp.usage.output_tokens},
            "model": resp.model,
        }

    # -- memory -------------------------------------------------------------------------------------

    async def memory_append(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        text = p.get("text")
        if not isinstance(text, str) or not text:
            raise InvalidInput("memory.append needs text")
        ev = await asyncio.to_thread(self.rt.memory(b.ts).episodic.remember, b.scope(p.get("scope", "user")),
                                     str(p.get("kind") or "note"), text, speaker="agent")
        return {"id": ev.id}

    async def memory_search(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        k = 5 if p.get("k") is None else p["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInput(f"ctx.memory.recall needs k as a whole number of at least 1, got {k!r}",
                               hint="k is how many memories to return (at most 50)")
        k = min(k, 50)
        hits = await asyncio.to_thread(self.rt.memory(b.ts).episodic.search, b.scope(p.get("scope", "user")),
                                       str(p.get("query") or ""), k=k)
        return {"hits": [h.as_json() for h in hits]}

    async def memory_facts(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(p.get("subject"), (str, type(None))):
            raise InvalidInput(f"ctx.memory.facts needs subject as a string, got {type(p['subject']).__name__}")
        times = {}
        for name, column in (("as_of", "valid_at"), ("known_at", "known_at")):
            v = p.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InvalidInput(f"ctx.memory.facts needs {name} as seconds since the epoch, got {v!r}",
                                   hint=f"pass {name}=time.time() - 3600 for an hour ago, or leave it out for now")
            times[column] = None if v is None else float(v)
        facts = await asyncio.to_thread(self.rt.memory(b.ts).semantic.recall, b.user_scope, subject=p.get("subject"),
                                        **times)
        return {"facts": [{"id": f.id, "subject": f.subject, "attribute": f.attribute, "value": f.value, "text": f.text,
                           "trust": f.trust, "since": f.valid_from} for f in facts]}

    async def memory_learn(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        from moorage.memory import FactCandidate, TurnRef

        fields = {n: p.get(n) for n in ("subject", "attribute", "value")}
        fields["text"] = p.get("text") or ""
        for name, v in fields.items():
            if not isinstance(v, str):  # None or a number would be stored as the text "None" or "7"
                raise InvalidInput(f"ctx.memory.learn needs {name} as a string, got {type(v).__name__}")
        cand = FactCandidate(fields["subject"], fields["attribute"], fields["value"], fields["text"])
        # The agent's own code is not the user: what it records lands as agent-origin (pending until confirmed).
        ch = await asyncio.to_thread(self.rt.memory(b.ts).semantic.record, b.user_scope, cand, origin="agent",
                                     turn=TurnRef(b.run_id, b.trace_id))  # named by the fact.pending webhook
        return {"action": ch.action, "status": ch.fact.status, "id": ch.fact.id}  # the id the product confirms

    async def memory_context(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(p.get("message"), str):  # None or a number would become the user's turn "None" or ""
            raise InvalidInput(f"ctx.memory.context needs message as a string, got {type(p.get('message')).__name__}")
        msgs = await asyncio.to_thread(self.rt.working_memory_input, b, p["message"],
                                       p.get("system") or "", p.get("tools") or [])
        return {"messages": msgs}

    # -- durable steps ------------------------------------------------------------------------------

    async def durable_begin(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        r = await _noting_divergence(b, asyncio.to_thread(b.engine.begin_step, b.run_id, int(p["seq"]), str(p["name"]),
                                                          p.get("idempotency_key")))
        if isinstance(r, Replay):
            return {"replay": True, "result": r.result, "error": r.error}
        return {"replay": False, "idempotency_key": r.idempotency_key, "attempt": r.attempt}

    async def durable_complete(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        await asyncio.to_thread(b.engine.complete_step, b.run_id, int(p["seq"]), str(p["name"]), p.get("result"),
                                idempotency_key=p.get("idempotency_key") or None, attempt=int(p.get("attempt") or 1))
        return {}

    async def durable_fail(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        attempt = int(p.get("attempt") or 1)
        retry = attempt <= max(0, int(p.get("retries") or 0))
        await asyncio.to_thread(b.engine.fail_step, b.run_id, int(p["seq"]), str(p["name"]), str(p.get("error"))[:2000],
                                attempt=attempt, final=not retry)
        return {"retry": retry, "backoff_s": DEFAULT_BACKOFF.delay(attempt, self.rt.rng) if retry else 0.0}

    async def durable_interrupt(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        r = await _noting_divergence(b, asyncio.to_thread(b.engine.interrupt, b.run_id, int(p["seq"]), p.get("payload")))
        return {"answered": True, "answer": r.value} if isinstance(r, Answer) else {"answered": False}

    async def durable_correct(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        note = p.get("note")
        if not isinstance(note, str) or not note.strip():
            raise InvalidInput("a correction needs a non-empty note")
        await asyncio.to_thread(b.engine.record_correction, b.run_id, int(p["seq"]), note[:4000])
        return {}

    async def durable_history(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        """The user's log from earlier turns of this agent (corrections, notes, failures), then this run's log;
        every entry names the turn that wrote it."""

        def read() -> tuple[list[dict[str, Any]], Any]:
            return earlier_entries(b.ts, b.run_id), b.engine.history(b.run_id)

        earlier, entries = await asyncio.to_thread(read)
        return {"history": earlier + [{"kind": e.kind, "step": e.name, "status": e.status, "attempt": e.attempt,
                                       "error": e.error, "note": e.note, "turn_id": b.run_id,
                                       "at": e.finished_at or e.started_at} for e in entries]}

    # -- egress (moorage/egress: the same policy and connector as the VM's gateway) -----------------------

    def _egress(self) -> Any:
        return egress_of(self.rt)

    def _secrets(self) -> Any:
        return secrets_of(self.rt)

    def _egress_for(self, b: TurnBinding) -> Any:
        """This instance's egress: its agent's policy, its limits, spans into the turn's trace, secret headers."""
        egress = self._egress()

        def record(started: float, status: str, attrs: dict[str, Any]) -> None:
            from moorage.store import Span

            b.ts.spans.record(Span(b.trace_id, uuid.uuid4().hex[:16], None, "egress", started, time.time(), status,
                                   {"agent": b.entity.agent, "user": b.entity.user, **attrs}, b.session_scope))

        headers = self._secrets().header_source(b.ts, b.entity.agent, b.entity.user, b.manifest)
        return egress.instance(b.manifest, record=record, headers=headers, usage=egress.usage_for(self.sandbox_id),
                               owner=b.ts.tenant_id)

    async def net_fetch(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        """HTTP on the agent's behalf under its egress policy; bound secrets are added here, never in the guest."""
        from moorage.egress import EgressFailed, fetch

        body: bytes | None = None
        headers = dict(p.get("headers") or {}) if isinstance(p.get("headers"), dict) else {}
        if p.get("json") is not None:
            body = json.dumps(p["json"]).encode()
            if not any(str(k).lower() == "content-type" for k in headers):
                headers["Content-Type"] = "application/json"
        elif isinstance(p.get("body"), str):
            body = p["body"].encode()
        if p.get("idempotency_key"):
            headers["Idempotency-Key"] = str(p["idempotency_key"])
        timeout = max(1.0, min(float(p.get("timeout") or 30.0), 120.0))
        try:
            r = await fetch(self._egress_for(b), str(p.get("method") or "GET"), p.get("url"), headers=headers,
                            body=body, timeout_s=timeout, max_body=MAX_FETCH_BYTES)
        except MoorageError:
            raise  # typed and worded for the guest (denied, limited, failed): never a raw socket error
        except Exception as e:  # noqa: BLE001 - anything else is reported as generically as a failed connection
            log.warning("fetch failed unexpectedly", error=type(e).__name__)
            raise EgressFailed("the request failed", hint="retry later") from None
        merged: dict[str, str] = {}
        for k, v in r.headers:
            merged[k.lower()] = f"{merged[k.lower()]}, {v}" if k.lower() in merged else v
        return {"status": r.status, "headers": merged, "body": r.body.decode("utf-8", "replace"),
                "truncated": r.truncated, "url": r.url}

    async def secrets_env(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        """The secrets this agent opted into its environment (``[agent.secrets] env``); none otherwise."""
        from moorage.secrets import Bindings

        bindings = Bindings.from_manifest(b.manifest)
        if not bindings.env:
            return {"env": {}}
        return {"env": await asyncio.to_thread(self._secrets().env, b.ts, b.entity.agent, b.entity.user, bindings)}

    # -- external MCP servers (runtime/mcp_tools.py; their credentials stay on the host) --------------

    async def mcp_tools(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        return {"tools": await self.rt.mcp.tools(b)}

    async def mcp_call(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        return await self.rt.mcp.call(b, p.get("server"), str(p.get("tool") or ""), p.get("arguments") or {})

    # -- time travel (moorage/timetravel) -------------------------------------------------------------

    async def timetravel_checkpoint(self, b: TurnBinding, p: dict[str, Any]) -> dict[str, Any]:
        """``ctx.checkpoint(name)``: a named checkpoint of this instance at this point of the turn."""
        name = p.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 100:
            raise InvalidInput("ctx.checkpoint needs a name of 1-100 characters")
        sandbox = await self.rt.driver.open(self.sandbox_id)
        ck = await self.rt.timetravel.take_in_turn(b, sandbox, name)
        return {"id": ck.id, "name": ck.name, "seq": ck.seq, "branch": ck.branch, "created_at": ck.created_at}
