"""Run one agent turn: JSON reply, server-sent events with ``Accept: text/event-stream`` / ``?stream=true``, or
detached with ``Prefer: respond-async`` / ``?async=true`` (202 and an execution id, see routes/executions.py).

The end-user comes from the end-user token when one is used; a tenant key names the user in the body.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from moorage.api import schemas as S
from moorage.api.invoke_shared import (entity_for, event_data, message_of, replay_headers, run_turn, stream_turn,
                                       wants_stream)
from moorage.api.routes.executions import EXECUTION, announce_interrupt, enforce_caps, submit, wants_async
from moorage.api.routing import Call, Endpoint, Param, Reply
from starlette.concurrency import run_in_threadpool
from moorage.api.sse import error_payload, event_stream, frame



async def invoke(call: Call) -> Any:
    entity = entity_for(call, call.path["agent"], call.field("user", str, required=False),
                        call.field("session", str, required=False))
    message = message_of(call)
    await enforce_caps(call, entity)
    if wants_async(call):
        return await submit(call, entity, message)
    if not wants_stream(call):
        result = await run_turn(call, entity, message)
        await run_in_threadpool(announce_interrupt, call, result)
        return Reply(S.turn(result), 200, replay_headers(result))

    events = await stream_turn(call, entity, message)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                if ev.kind == "done":
                    await run_in_threadpool(announce_interrupt, call, ev.data)
                yield frame(ev.kind, event_data(ev))
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield frame("error", error_payload(e, call.trace_id))

    return event_stream(frames(), call.trace_id, keepalive_s=call.ctx.config.sse_keepalive_s)


ENDPOINTS = [
    Endpoint("POST", "/v1/agents/{agent}/invoke", invoke, "Run one turn of the agent for a user", "invoke",
             "invokeAgent", scope="invoke", end_user=True, streams=True, idempotency="runtime",
             query=(Param("stream", {"type": "boolean"}, "answer with server-sent events"),
                    Param("async", {"type": "boolean"}, "run detached: 202 with an execution id (or Prefer: respond-async)")),
             body=S.obj({"message": {"type": "string", "minLength": 1}, "user": S.ID, "session": S.ID}, ["message"]),
             response=S.ref("TurnResult"), other_responses=((202, EXECUTION),)),
]
