"""Long work a request starts and that runs on its own (a deploy's build, the deletion of an agent or a tenant):
answered as JSON once done, or streamed as ``progress`` events then its answer."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from moorage.api.invoke_shared import wants_stream
from moorage.api.routing import Call, Reply
from moorage.api.sse import error_payload, event_stream, frame
from moorage.log import get_logger

log = get_logger(__name__)


async def detached(call: Call, name: str, start: Callable[[Callable[[str], None]], Awaitable[Any]], event: str,
                   body: Callable[[Any], dict[str, Any]], status: int) -> Reply:
    """Long work (a build, an agent's or a tenant's deletion) that runs on its own: a caller that leaves (or whose
    credential ends meanwhile) does not cut it in the middle. Answered as JSON once it is done (``status``,
    ``body(result)``), or, with ``Accept: text/event-stream`` (``?stream=true``), as ``progress`` events
    ({message}) as it goes and then ``event`` with the same body (or ``error``, a problem)."""
    loop = asyncio.get_running_loop()
    said: asyncio.Queue[str] = asyncio.Queue()
    work = loop.create_task(start(lambda m: loop.call_soon_threadsafe(said.put_nowait, str(m))), name=name)
    _running.add(work)
    work.add_done_callback(_settled)
    if not wants_stream(call):
        return Reply(body(await asyncio.shield(work)), status)

    async def frames() -> AsyncIterator[bytes]:
        step: asyncio.Task[str] | None = None
        try:
            while not work.done():
                step = loop.create_task(said.get())
                await asyncio.wait({step, work}, return_when=asyncio.FIRST_COMPLETED)
                if step.done():
                    message, step = step.result(), None
                    yield frame("progress", {"message": message})
            while not said.empty():
                yield frame("progress", {"message": said.get_nowait()})
            yield frame(event, body(work.result()))
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield frame("error", error_payload(e, call.trace_id))
        finally:
            if step is not None:
                step.cancel()

    async def answer() -> Reply:  # the JSON answer the work ends with: an Idempotency-Key's to replay
        return Reply(body(await asyncio.shield(work)), status)

    response = event_stream(frames(), call.trace_id, keepalive_s=call.ctx.config.sse_keepalive_s)
    response.settles = answer  # type: ignore[attr-defined]
    return response


#: Builds and deletions running (a reference each, until they end: a caller that left does not own them).
_running: set[asyncio.Task[Any]] = set()


def _settled(work: asyncio.Task[Any]) -> None:
    _running.discard(work)
    if not work.cancelled() and work.exception() is not None:  # its caller, if still there, was told
        log.info("long work failed", work=work.get_name(), error=str(work.exception()))
