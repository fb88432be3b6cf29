"""What a turn is on its way through the runtime: its result and streamed events, its errors (the agent's own failure,
a limit on its host call), its bounded event queue, and its id (an Idempotency-Key maps to one turn)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from moorage.errors import InvalidInput, MoorageError
from moorage.store import EntityKey, Principal, TenantStore

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


class TurnTimedOut(AgentTurnFailed):
    """The agent's turn ran past its bound (``[agent.limits] turn_timeout_s``, else 600 s) and was stopped there.
    Settled as the agent's failure, as an exception of its code is."""

    code = "turn-timeout"
    http_status = 504

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the agent's turn ran longer than its {timeout_s:g} s and was stopped",
                         hint="look for what the agent's code waits on (a call without a timeout, a loop that does "
                              "not end); raise [agent.limits] turn_timeout_s in moorage.toml if its turns need longer")


class OnWakeTimedOut(TurnTimedOut):
    """The turn's time ran out while the agent's ``on_wake`` (run before the first turn after a start or a wake) had
    not returned: the turn's handler was never reached. Said as such, not as a plain ``turn-timeout``."""

    code = "on-wake-timeout"

    def __init__(self, timeout_s: float) -> None:
        AgentTurnFailed.__init__(
            self, f"the agent's on_wake did not return within the turn's {timeout_s:g} s, so the turn's handler "
                  "was not reached",
            hint="start the agent's processes from on_wake without waiting for them (ctx.spawn returns at once); it "
                 "runs again before the next turn; raise [agent.limits] turn_timeout_s in moorage.toml if it needs "
                 "longer")


class SandboxStopped(MoorageError):
    """The agent's sandbox stopped while the turn ran: its guest process exited or was killed (an exit in the
    agent's code, its memory limit, a crash), or the host stopped it. Unlike ``AgentTurnFailed`` the run is not
    settled as the agent's failure: the same turn asked again (same Idempotency-Key) runs again, its journaled
    steps replayed, in a sandbox started afresh from its disk."""

    code = "sandbox-stopped"
    http_status = 502
    for_caller = True
    retryable = False  # not automatically: an agent that ends its own process would only do it again

    def __init__(self, reason: str) -> None:
        again = "send the turn again (with the same Idempotency-Key its journaled steps are not run twice)"
        if reason.startswith("killed for memory"):  # the driver knows it (process driver: the cgroup's OOM kill)
            super().__init__(f"the agent's sandbox stopped during the turn: {reason}",
                             hint="the agent's code used more memory than its memory_mib: raise memory_mib in "
                                  f"moorage.toml's [agent] or make the code use less; then {again}")
            return
        super().__init__(f"the agent's sandbox stopped during the turn ({reason})",
                         hint=f"{again}; if it happens again, look for an exit in the agent's code (sys.exit, "
                              "os._exit) or a process killed for memory (raise memory_mib)")


class TurnLimited(MoorageError):
    """A limit on the agent's own host call (the tenant's model rate or token budget) ended the turn: answered
    as that limit (429, with when to come back), not as the agent's failure, and a retry later runs it again."""

    http_status = 429
    for_caller = True

    def __init__(self, message: str, *, code: str, retry_after: float | None, hint: str | None) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.retry_after = retry_after
        if code == "budget-exceeded" and retry_after is None:
            self.retryable = False  # a budget that never resets: asked again, refused again (BudgetExceeded)


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


def _turn_id(principal: Principal, entity: EntityKey, idempotency_key: str | None) -> str:
    if idempotency_key is None:
        return uuid.uuid4().hex
    if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= 200:
        raise InvalidInput("Idempotency-Key must be 1-200 characters")
    # Same key, same entity → same turn: a retried request finds the first one's result.
    h = hashlib.sha256(f"{principal.tenant_id}/{entity.agent}/{entity.user}/{idempotency_key}".encode()).hexdigest()
    return h[:32]
