"""Turn helpers shared by the native invoke route and the OpenAI facade: entity binding, metrics.

An end-user token pins the agent and user; a tenant key must name the user explicitly.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from moorage.api import schemas as S
from moorage.api.routing import Call
from moorage.errors import InvalidInput, TenantScopeError
from moorage.store import EntityKey

MAX_MESSAGE_CHARS = 256 * 1024


def wants_stream(call: Call) -> bool:
    if (call.query("stream") or "").lower() in ("1", "true", "yes"):
        return True
    return "text/event-stream" in call.request.headers.get("accept", "")


def entity_for(call: Call, agent: str, user: str | None, session: str | None) -> EntityKey:
    """The entity a turn addresses; an end-user token pins agent and user to its own."""
    p = call.who
    if p.user is not None:
        if user is not None and user != p.user:
            raise TenantScopeError("this end-user token is for another user", hint="omit `user` or use that user's token")
        if agent != p.agent:
            raise TenantScopeError("this end-user token is for another agent", hint="use the token issued for this agent")
        user = p.user
    if user is None:
        raise InvalidInput("missing field 'user'", hint="name the end-user this turn is for (or use an end-user token)")
    return EntityKey(agent, user, session)


async def run_turn(call: Call, entity: EntityKey, message: str) -> Any:
    # Its metrics are the runtime's, as every turn's (``observability/events.py``): async ones and webhooks' too.
    return await call.runtime.invoke(call.who, entity, message, idempotency_key=call.idempotency_key)


def replay_headers(result: Any) -> dict[str, str]:
    """``Idempotent-Replayed: true`` on the answer to a turn asked again, as on every other idempotent route."""
    return {"Idempotent-Replayed": "true"} if getattr(result, "replayed", False) else {}


async def stream_turn(call: Call, entity: EntityKey, message: str) -> AsyncIterator[Any]:
    """Start the turn and wait for its first event, so that refusals (no such agent, wrong user: found at once)
    still become a problem response with their own status; later failures can only be reported in-band. A first
    event slower than ``sse_keepalive_s`` (a cold start, a quiet agent) does not hold the answer back: the stream
    starts, with its keep-alives, and the event comes when it comes."""
    events = call.runtime.stream(call.who, entity, message, idempotency_key=call.idempotency_key).__aiter__()
    first_event = asyncio.ensure_future(events.__anext__())
    await asyncio.wait({first_event}, timeout=call.ctx.config.sse_keepalive_s or None)
    if first_event.done():
        try:
            first_event.result()  # a refusal is raised here, before the answer's status is sent
        except StopAsyncIteration:
            pass

    async def rest() -> AsyncIterator[Any]:
        try:
            step: Any = first_event
            while True:
                try:
                    ev = await step
                except StopAsyncIteration:
                    return
                yield ev
                step = events.__anext__()
        finally:
            first_event.cancel()  # the caller left before the first event: the turn's stream is closed with it

    return rest()


def message_of(call: Call) -> str:
    message = call.field("message", str)
    if not message.strip():
        raise InvalidInput("empty message", hint="send the user's message as `message`")
    if len(message) > MAX_MESSAGE_CHARS:
        raise InvalidInput(f"message longer than {MAX_MESSAGE_CHARS} characters")
    return message


def event_data(ev: Any) -> Any:
    """A stream event's payload as JSON-ready data (the final ``done`` carries a TurnResult)."""
    return S.turn(ev.data) if ev.kind == "done" and hasattr(ev.data, "turn_id") else ev.data
