"""Server-sent events: turn a runtime's ``TurnEvent`` stream into ``text/event-stream`` frames.

A failure after the stream has started cannot change the status code, so it is sent as an ``error`` event. A
stream that has sent nothing for a while sends a comment line (``: keep-alive``), which every SSE client skips, so
that proxies in between (nginx cuts after 60 s of silence by default) and the fleet's forwarding (its read timeout
is 11 minutes) do not cut a turn or an exec that is quiet for a while.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from moorage.errors import MoorageError, disk_full
from moorage.log import get_logger

log = get_logger(__name__)


def frame(event: str, data: Any) -> bytes:
    text = data if isinstance(data, str) and event == "raw" else json.dumps(data, default=str)
    return f"event: {event}\ndata: {text}\n\n".encode()


def error_payload(e: BaseException, trace_id: str) -> dict[str, Any]:
    e = disk_full(e) or e  # the disk being full is said as such, whatever raised it
    if isinstance(e, MoorageError) and (e.http_status < 500 or e.http_status == 503 or e.for_caller):
        return {"type": e.code, "status": e.http_status, "detail": e.message, "hint": e.hint, "trace_id": trace_id}
    log.error("stream failed", trace_id=trace_id, error=type(e).__name__, exc_info=e)
    return {"type": "internal", "status": 500, "detail": "the turn failed", "hint": f"report trace id {trace_id}",
            "trace_id": trace_id}


KEEPALIVE = b": keep-alive\n\n"


async def with_keepalive(frames: AsyncIterator[bytes], every_s: float) -> AsyncIterator[bytes]:
    """``frames`` as they come, with ``KEEPALIVE`` whenever ``every_s`` seconds pass without one (0: never).

    ``frames`` runs in a task of its own (one context for all of it, as when iterated directly), at most one frame
    ahead of the caller; closing this generator (the caller left) cancels that task, which closes ``frames``."""
    if every_s <= 0:
        async for chunk in frames:
            yield chunk
        return
    ahead: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for chunk in frames:
                await ahead.put((chunk, None))
        except Exception as e:  # noqa: BLE001 - handed to the caller, raised there
            await ahead.put((None, e))
            return
        await ahead.put((None, None))

    task = asyncio.get_running_loop().create_task(pump(), name="sse-frames")
    get: asyncio.Future[tuple[bytes | None, BaseException | None]] | None = None
    try:
        while True:
            if get is None:
                get = asyncio.ensure_future(ahead.get())
            done, _ = await asyncio.wait({get}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            chunk, err = get.result()
            get = None
            if err is not None:
                raise err
            if chunk is None:
                return
            yield chunk
    finally:
        if get is not None:
            get.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its end, without raising its cancellation here (ours still would)


def event_stream(frames: AsyncIterator[bytes], trace_id: str, on_close: Callable[[], None] | None = None, *,
                 keepalive_s: float = 15.0) -> StreamingResponse:
    """``frames`` as a ``text/event-stream`` answer, with a keep-alive comment after ``keepalive_s`` of silence."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in with_keepalive(frames, keepalive_s):
                yield chunk
        finally:
            if on_close is not None:
                on_close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no", "X-Trace-Id": trace_id})
