"""Serving the guest's calls on the host (a part of ``Channel``): handlers registered by method, each request served
in a task of its own (charged to the guest's share), its answer or error sent back, a ``$cancel`` honoured."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from moorage.log import get_logger
from moorage.sandbox.base import ChannelClosed, ChannelError
from moorage.sandbox.channel_share import Charged, Share
from moorage.sandbox.channel_wire import APPLICATION_ERROR, CANCELLED, INTERNAL_ERROR, METHOD_NOT_FOUND, TOO_LARGE

if TYPE_CHECKING:
    from moorage.sandbox.channel import Channel

log = get_logger("moorage.sandbox.channel")


class HandlerContext:
    """Given to host-side handlers of guest-originated calls: stream events back, or call the guest."""

    def __init__(self, channel: "Channel", request_id: Any, frame_bytes: int = 0) -> None:
        self.channel = channel
        self.request_id = request_id
        #: The size of the request's frame as it came from the guest (what a handler that keeps it may count).
        self.frame_bytes = frame_bytes

    async def emit(self, event: str, data: Any = None) -> None:
        await self.channel._send({"id": self.request_id, "event": event, "data": data})


Handler = Callable[[Any, HandlerContext], Awaitable[Any]]


class HandlerError(Exception):
    """Raise from a handler to answer with a specific error code and data instead of INTERNAL_ERROR."""

    def __init__(self, message: str, code: int = APPLICATION_ERROR, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


class Serving:
    """``Channel``'s serving of guest-originated calls (it holds the state this uses: the handlers, the requests
    being served, the guest's share)."""

    def _on_notification(self, method: str, params: Any) -> None:
        if method == "$cancel":
            target = params.get("id") if isinstance(params, dict) else None
            task = self._serving.get(target) if isinstance(target, (int, str)) else None
            if task is not None:
                task.cancel()
            return
        self._reject("unknown notification", method=method[:100])

    def _on_request(self, rid: Any, method: str, params: Any, size: int = 0) -> None:
        serve = self._serve(rid, method, params, size)
        if self.share is not None:
            serve = self._charged(serve, self.share)
        self._serving[rid] = asyncio.get_running_loop().create_task(serve)

    @staticmethod
    async def _charged(serve: Awaitable[None], share: Share) -> None:
        await Charged(serve, share)  # type: ignore[arg-type]

    async def _serve(self, rid: Any, method: str, params: Any, size: int = 0) -> None:
        try:
            handler = self._handlers.get(method)
            if handler is None:
                await self._safe_send(
                    {"id": rid, "error": {"code": METHOD_NOT_FOUND, "message": f"host has no method {method!r}"}}
                )
                return
            try:
                result = await handler(params, HandlerContext(self, rid, size))
            except asyncio.CancelledError:
                await self._safe_send({"id": rid, "error": {"code": CANCELLED, "message": "cancelled"}})
                return
            except HandlerError as e:
                await self._safe_send({"id": rid, "error": {"code": e.code, "message": str(e), "data": e.data}})
                return
            except Exception as e:  # a handler bug must not kill the channel; the guest gets an error answer
                log.exception("host handler failed", channel=self.name, method=method)
                await self._safe_send({"id": rid, "error": {"code": INTERNAL_ERROR, "message": f"{type(e).__name__}: {e}"}})
                return
            try:
                await self._send({"id": rid, "result": result})
            except ChannelClosed:
                pass
            except ChannelError as e:  # result too large or not JSON-serialisable
                await self._safe_send({"id": rid, "error": {"code": TOO_LARGE, "message": str(e)}})
            except TypeError as e:
                await self._safe_send({"id": rid, "error": {"code": INTERNAL_ERROR, "message": f"result not JSON: {e}"}})
        finally:
            self._serving.pop(rid, None)
