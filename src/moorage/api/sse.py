"""Server-sent events: turn a runtime's ``TurnEvent`` stream into ``text/event-stream`` frames.

A failure after the stream has started cannot change the status code, so it is sent as an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from moorage.errors import MoorageError
from moorage.log import get_logger

log = get_logger(__name__)


def frame(event: str, data: Any) -> bytes:
    text = data if isinstance(data, str) and event == "raw" else json.dumps(data, default=str)
    return f"event: {event}\ndata: {text}\n\n".encode()


def error_payload(e: BaseException, trace_id: str) -> dict[str, Any]:
    if isinstance(e, MoorageError) and e.http_status < 500 or isinstance(e, MoorageError) and e.http_status == 503:
        return {"type": e.code, "status": e.http_status, "detail": e.message, "hint": e.hint, "trace_id": trace_id}
    log.error("stream failed", trace_id=trace_id, error=type(e).__name__, exc_info=e)
    return {"type": "internal", "status": 500, "detail": "the turn failed", "hint": f"report trace id {trace_id}",
            "trace_id": trace_id}


def event_stream(frames: AsyncIterator[bytes], trace_id: str, on_close: Callable[[], None] | None = None) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in frames:
                yield chunk
        finally:
            if on_close is not None:
                on_close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no", "X-Trace-Id": trace_id})
