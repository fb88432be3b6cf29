"""Run one agent turn: JSON reply, or server-sent events with ``Accept: text/event-stream`` / ``?stream=true``.

The end-user comes from the end-user token when one is used; a tenant key names the user in the body.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from moorage.api import schemas as S
from moorage.api.invoke_shared import entity_for, event_data, message_of, run_turn, stream_turn, wants_stream
from moorage.api.routing import Call, Endpoint, Param
from moorage.api.sse import error_payload, event_stream, frame



async def invoke(call: Call) -> Any:
    entity = entity_for(call, call.path["agent"], call.field("user", str, required=False),
                        call.field("session", str, required=False))
    message = message_of(call)
    if not wants_stream(call):
        return S.turn(await run_turn(call, entity, message))

    events = await stream_turn(call, entity, message)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                yield frame(ev.kind, event_data(ev))
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield frame("error", error_payload(e, call.trace_id))

    return event_stream(frames(), call.trace_id)


ENDPOINTS = [
    Endpoint("POST", "/v1/agents/{agent}/invoke", invoke, "Run one turn of the agent for a user", "invoke",
             "invokeAgent", scope="invoke", end_user=True, streams=True, idempotency="runtime",
             query=(Param("stream", {"type": "boolean"}, "answer with server-sent events"),),
             body=S.obj({"message": {"type": "string", "minLength": 1}, "user": S.ID, "session": S.ID}, ["message"]),
             response=S.ref("TurnResult")),
]
