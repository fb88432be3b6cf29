"""The router: entity key (+ the principal's tenant) → instance → placement from the store → wake → forward the turn.

It also owns turn ordering (FIFO per session; queue, reject or parallel across sessions of one instance) and
backpressure (bounded queues: overload is a typed ``Overloaded`` with a retry-after, never a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from moorage.errors import ConflictError, MoorageError, NotFound, TenantScopeError
from moorage.lifecycle.config import AgentLifecycle
from moorage.lifecycle.machine import TraceContext
from moorage.lifecycle.manager import InstanceManager
from moorage.sandbox import Sandbox, TemplateRef
from moorage.store import Agent, EntityKey, Principal, SandboxRecord, Scope, Store, TenantStore
from moorage.store.repos.agents import refuse_if_deleting

#: Supplied by the runtime: run one turn in the agent's sandbox and return its result.
Forward = Callable[[Sandbox, Any], Awaitable[Any]]
#: Supplied by the runtime: the template an agent's new instances are forked from (its live deployment's).
TemplateFinder = Callable[[TenantStore, Agent], Awaitable[TemplateRef]]
#: Supplied by the runtime: a last check of a turn once it holds its instance, just before it runs (the user's caps:
#: turns that waited in line behind others were checked when they arrived, before those others spent anything).
Admit = Callable[[TenantStore, EntityKey, Any], Awaitable[None]]


class Busy(ConflictError):
    """The instance is serving another session and the agent's concurrency policy is ``reject``."""

    code = "busy"
    http_status = 409

    def __init__(self, scope: Scope) -> None:
        super().__init__(f"the agent instance of {scope} is busy with another session's turn",
                         hint="retry when that turn ends, or set lifecycle.concurrency = \"queue\" on the agent")


class Overloaded(MoorageError):
    """Too many turns are waiting; nothing was started. Retry after ``retry_after_s`` seconds (HTTP 429)."""

    code = "overloaded"
    http_status = 429

    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(f"too many turns waiting for {what}", hint=f"retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


def _set(ev: asyncio.Event) -> asyncio.Event:
    ev.set()
    return ev


@dataclass(eq=False)
class _Line:
    """A FIFO of turns: ``asyncio.Lock`` wakes waiters in arrival order and newcomers never jump the line."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Turns holding or waiting for the lock.
    members: int = 0
    #: The session whose turn holds the instance (for the reject policy).
    holder: str | None = None
    #: Turns running side by side (parallel policy), and set when none is.
    running: int = 0
    drained: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))


def _forgotten(key: EntityKey) -> ConflictError:
    return ConflictError(f"user {key.user!r} of agent {key.agent!r} was forgotten while this turn waited",
                         hint="send it again to start over as a new user")


class Router:
    """Routes turns for one host process. Stateless across restarts: placement is read from the store each turn."""

    def __init__(self, store: Store, manager: InstanceManager, forward: Forward, templates: TemplateFinder, *,
                 max_pending: int = 1024, max_session_queue: int = 32, max_user_pending: int = 128,
                 retry_after_s: float = 1.0, admit: Admit | None = None) -> None:
        self.store = store
        self.manager = manager
        self.forward = forward
        self.templates = templates
        self.max_pending = max_pending
        #: Turns one session may have waiting behind its running turn; beyond it: Overloaded.
        self.max_session_queue = max_session_queue
        #: Turns one end-user (of one agent) may have admitted at once, over all their sessions; beyond it:
        #: Overloaded. Sessions are the caller's to name, so without it one end-user's token could take every one
        #: of the host's ``max_pending`` places and every other tenant's turns were refused.
        self.max_user_pending = max_user_pending
        self.retry_after_s = retry_after_s
        self.admit = admit
        self._pending = 0
        self._user_pending: dict[tuple[str, str, str], int] = {}
        self._sessions: dict[tuple[str, ...], _Line] = {}
        self._instances: dict[tuple[str, str], _Line] = {}

    def holders(self, tenant_id: str) -> dict[str, str]:
        """The tenant's instances (scope keys) whose line is held by one holder now, and by what: a session's
        turn, or an operation's mark (``timetravel.holding.LINE_HOLDER``)."""
        return {key: line.holder for (tid, key), line in list(self._instances.items())
                if tid == tenant_id and line.holder is not None}

    @property
    def pending(self) -> int:
        """Turns admitted and not yet answered (waiting or running)."""
        return self._pending

    # --- resolution -----------------------------------------------------------------------------------------

    def check_principal(self, principal: Principal, key: EntityKey) -> None:
        principal.require("invoke")
        # End-user tokens act for one user of one agent only.
        if principal.agent is not None and principal.agent != key.agent:
            raise TenantScopeError(f"this key may only call agent {principal.agent!r}")
        if principal.user is not None and principal.user != key.user:
            raise TenantScopeError(f"this key may only act for user {principal.user!r}")

    @staticmethod
    def resolve(ts: TenantStore, key: EntityKey,
                user_since: float | None = None) -> tuple[Agent, AgentLifecycle, Scope]:
        """The agent, its lifecycle and the turn's scope, the user registered if the agent makes users as they
        come. ``user_since`` (when the user the turn was accepted for was registered): a user forgotten since is
        refused (409) here, before registering anyone: the turn must not make the user it waited for again."""
        agent = ts.agents.get(key.agent)  # NotFound: never provision an instance of an agent that does not exist
        refuse_if_deleting(agent)  # 409: its users are being forgotten, none is made or woken again
        lc = AgentLifecycle.of(agent)
        # End-users are a resource of one agent: a user of agent A is no user of agent B (a read on the hot path).
        found = ts.agent_users.find(key.agent, key.user)
        if user_since is not None and (found is None or found.created_at != user_since):
            raise _forgotten(key)
        if found is None:
            # A user who already talked to this agent before users were per agent (a session of theirs exists)
            # is registered now rather than locked out.
            if lc.users != "auto" and not ts.sessions.list(key.agent, key.user, limit=1):
                raise NotFound(f"agent {key.agent!r} has no user {key.user!r}",
                               hint=f"create the end-user first (PUT /v1/agents/{key.agent}/users/{key.user}), "
                                    "or set lifecycle.users = \"auto\" on the agent")
            ts.agent_users.put(key.agent, key.user)
        return agent, lc, key.scope(lc.scope)

    async def locate(self, principal: Principal, key: EntityKey) -> SandboxRecord | None:
        """Where the key's instance is, from the store (None: not provisioned yet). Creates nothing."""
        self.check_principal(principal, key)
        ts = self.store.tenant(principal)
        agent = await asyncio.to_thread(ts.agents.get, key.agent)
        lc = AgentLifecycle.of(agent)
        return await asyncio.to_thread(ts.sandboxes.for_scope, key.scope(lc.scope))

    # --- the turn -------------------------------------------------------------------------------------------

    async def route(self, principal: Principal, key: EntityKey, turn: Any, *, trace: TraceContext | None = None,
                    user_since: float | None = None) -> Any:
        """Run one turn for ``key`` on behalf of ``principal`` and return what ``forward`` returned.

        ``user_since``: when the user the turn was accepted for was registered; a turn whose user was forgotten
        while it waited in line (made again since, or not) is refused (409) instead of run.

        Raises NotFound (unknown agent/user), Busy (409), Overloaded (429), TenantScopeError, UnavailableError.
        """
        self.check_principal(principal, key)
        if self._pending >= self.max_pending:
            raise Overloaded("this host", self.retry_after_s)
        ts = self.store.tenant(principal)
        user_key = (ts.tenant_id, key.agent, key.user)
        if self._user_pending.get(user_key, 0) >= self.max_user_pending:
            raise Overloaded(f"user {key.user!r} of agent {key.agent!r} (at most {self.max_user_pending} at once)",
                             self.retry_after_s)
        self._pending += 1
        self._user_pending[user_key] = self._user_pending.get(user_key, 0) + 1
        try:
            session = key.session or key.workflow or "-"
            # The line is joined before the first await, so turns of one session keep the order they arrived in.
            async with self._in_session_line((ts.tenant_id, key.agent, key.user, session)):
                # A user forgotten while this turn waited in its session's line is refused there, unregistered.
                agent, lc, scope = await asyncio.to_thread(self.resolve, ts, key, user_since)
                async with self._on_instance((ts.tenant_id, scope.key), session, scope, lc):
                    # ``resolve`` registered the user; gone (or made again) now only if they were forgotten while
                    # this turn waited in line (the forget holds the line): it must not run for someone else.
                    now = await asyncio.to_thread(ts.agent_users.find, key.agent, key.user)
                    if now is None or (user_since is not None and now.created_at != user_since):
                        raise _forgotten(key)
                    if self.admit is not None:
                        await self.admit(ts, key, turn)

                    async def template() -> TemplateRef:
                        return await self.templates(ts, agent)

                    async with self.manager.turn(ts, scope, template, lifecycle=lc, trace=trace) as sandbox:
                        return await self.forward(sandbox, turn)
        finally:
            self._pending -= 1
            left = self._user_pending.pop(user_key) - 1
            if left:
                self._user_pending[user_key] = left

    @contextlib.asynccontextmanager
    async def _in_session_line(self, key: tuple[str, ...]) -> AsyncIterator[None]:
        """Turns of one session run one at a time, in arrival order."""
        line = self._sessions.get(key)
        if line is None:
            line = self._sessions[key] = _Line()
        if line.members > self.max_session_queue:
            raise Overloaded(f"session {key[-1]!r}", self.retry_after_s)
        line.members += 1
        try:
            async with line.lock:
                yield
        finally:
            line.members -= 1
            if line.members == 0:
                self._sessions.pop(key, None)

    @contextlib.asynccontextmanager
    async def _on_instance(self, key: tuple[str, str], session: str, scope: Scope,
                           lc: AgentLifecycle, *, exclusive: bool = False) -> AsyncIterator[None]:
        """Turns of different sessions on one instance: wait in line (queue), 409 (reject) or side by side (parallel).

        ``exclusive`` (a rollback or a fork of the instance): alone on it whatever the policy, in line after the turns
        before it (on a parallel agent: once those running side by side have ended; those arriving meanwhile wait)."""
        line = self._instances.get(key)
        if line is None:
            line = self._instances[key] = _Line()
        if lc.concurrency == "parallel" and not exclusive:
            line.members += 1
            try:
                async with line.lock:  # held only by an exclusive holder for long: wait for it, never for a turn
                    line.running += 1
                    line.drained.clear()
                try:
                    yield
                finally:
                    line.running -= 1
                    if line.running == 0:
                        line.drained.set()
            finally:
                line.members -= 1
                if line.members == 0:
                    self._instances.pop(key, None)
            return
        if lc.concurrency == "reject" and line.lock.locked() and line.holder != session:
            raise Busy(scope)
        if line.members > lc.max_queue:
            raise Overloaded(f"the instance of {scope}", self.retry_after_s)
        line.members += 1
        try:
            async with line.lock:
                if exclusive:
                    await line.drained.wait()  # a parallel agent's turns already running end first
                line.holder = session
                try:
                    yield
                finally:
                    line.holder = None
        finally:
            line.members -= 1
            if line.members == 0:
                self._instances.pop(key, None)
