"""Guest side of the channel protocol (docs/channel.md): frames, the method registry and one Peer per connection.

Stdlib only. Mirrors moorage/sandbox/channel.py, which the guest must not import.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
import sys
from typing import Any, Awaitable, Callable, Dict, Optional

MAX_FRAME = 8 << 20
#: Deepest JSON nesting a frame may carry, as on the host (sandbox/channel.py); deeper is invalid JSON.
MAX_DEPTH = 64
_HEADER = struct.Struct(">I")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
CANCELLED = -32800
TOO_LARGE = -32001
BUSY = -32002  # the peer serves too many of our requests at once: retry later
APPLICATION_ERROR = -32000


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr; the driver collects the supervisor's stderr into the sandbox log."""
    try:
        sys.stderr.write(json.dumps({"event": event, **fields}, default=str) + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _decode(payload: bytes) -> Any:
    """One frame's JSON; ValueError for bad UTF-8, bad JSON, or containers nested deeper than MAX_DEPTH."""
    try:
        msg = json.loads(payload.decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    if payload.count(b"[") + payload.count(b"{") > MAX_DEPTH:  # else it cannot nest that deep: no walk
        level, todo = 1, [msg]
        while todo:  # breadth first, one level at a time (no recursion: a deep value cannot overflow the stack)
            if level > MAX_DEPTH:
                raise ValueError("JSON nested deeper than %d levels" % MAX_DEPTH)
            todo = [v for c in todo for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
            level += 1
    return msg


class RpcError(Exception):
    """Raise from a handler to answer with this error code and data; also raised by ``Peer.call``."""

    def __init__(self, message: str, code: int = APPLICATION_ERROR, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


class PeerClosed(RpcError):
    def __init__(self, reason: str) -> None:
        super().__init__("channel closed: " + reason, INTERNAL_ERROR)


class Context:
    """What a handler gets besides its params: stream events back, call the host, know its request id."""

    def __init__(self, peer: "Peer", request_id: Any) -> None:
        self.peer = peer
        self.request_id = request_id

    async def emit(self, event: str, data: Any = None) -> None:
        await self.peer.send({"id": self.request_id, "event": event, "data": data})


Handler = Callable[[Any, Context], Awaitable[Any]]


class Registry:
    """Methods the supervisor serves. Extension modules add theirs through ``register(registry)``."""

    def __init__(self) -> None:
        self._handlers: Dict[str, Handler] = {}

    def add(self, method: str, handler: Handler) -> None:
        if method.startswith("$"):
            raise ValueError("methods starting with '$' are reserved for the protocol")
        self._handlers[method] = handler

    def get(self, method: str) -> Optional[Handler]:
        return self._handlers.get(method)

    def names(self) -> list:
        return sorted(self._handlers)


class Peer:
    """One connection: serves registered methods concurrently and lets the guest call the host."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any, registry: Registry, max_frame: int = MAX_FRAME) -> None:
        self.reader = reader
        self.writer = writer
        self.registry = registry
        self.max_frame = max_frame
        self._write_lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._pending: Dict[int, "tuple[asyncio.Future, Optional[Callable[[str, Any], Any]]]"] = {}
        self._serving: Dict[Any, asyncio.Task] = {}
        #: Tasks serving requests of a host that went away (cancelled at shutdown): see ``call``.
        self._abandoned: "set[asyncio.Task]" = set()
        self.closed = False
        self.rejected_frames = 0

    async def send(self, msg: dict) -> None:
        payload = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(payload) > self.max_frame:
            raise RpcError("message of %d bytes exceeds the frame limit" % len(payload), TOO_LARGE)
        if self.closed:
            raise PeerClosed("closed")
        async with self._write_lock:
            try:
                self.writer.write(_HEADER.pack(len(payload)) + payload)
                await self.writer.drain()
            except (OSError, RuntimeError) as e:
                self._shutdown("write failed: %s" % e)
                raise PeerClosed(str(e)) from e

    async def _safe_send(self, msg: dict) -> None:
        try:
            await self.send(msg)
        except RpcError as e:
            error = msg.get("error")
            if e.code == TOO_LARGE and isinstance(error, dict):
                # An error too large for a frame (a handler's exception with a huge text) is still answered, cut:
                # dropped, its call would wait for its whole timeout.
                text = str(error.get("message", ""))
                cut = {"code": error.get("code"), "message": "%s... (an error of %d characters, cut)"
                       % (text[:4000], len(text))}
                try:
                    await self.send({"id": msg.get("id"), "error": cut})
                except RpcError:
                    pass

    async def call(self, method: str, params: Any = None, timeout: Optional[float] = 60.0,
                   on_event: Optional[Callable[[str, Any], Any]] = None) -> Any:
        """Call a method the host serves (e.g. a model call). Raises ``RpcError`` on an error answer."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, on_event)
        try:
            await self.send({"id": rid, "method": method, "params": {} if params is None else params})
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's drops a cancel that comes with the answer,
                return await fut  # and the handler cancelled by its host would run on
        except (asyncio.TimeoutError, asyncio.CancelledError):
            if not self.closed:
                await self._safe_send({"method": "$cancel", "params": {"id": rid}})
            raise
        except PeerClosed:
            # The host went away (for a VM, also a restore from a snapshot: the host that would answer this call
            # is gone, and a rollback may have put everything after it aside). A task serving that host's request
            # is cancelled; it must see the cancellation, not an error its code may catch and go on from (a call
            # it makes after the cancel, from code that caught it, fails here).
            if asyncio.current_task() in self._abandoned:
                raise asyncio.CancelledError() from None
            raise
        finally:
            self._pending.pop(rid, None)

    def _reject(self, why: str, **fields: Any) -> None:
        self.rejected_frames += 1
        log("rejected host frame", reason=why, **fields)

    async def serve(self) -> str:
        """Read frames until the connection ends; returns why it ended."""
        reason = "host closed the connection"
        try:
            while True:
                try:
                    header = await self.reader.readexactly(_HEADER.size)
                except asyncio.IncompleteReadError:
                    break
                (length,) = _HEADER.unpack(header)
                if length == 0 or length > self.max_frame:
                    self._reject("bad frame length", length=length)
                    reason = "bad frame length %d" % length
                    break
                try:
                    payload = await self.reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    reason = "connection closed mid-frame"
                    break
                try:
                    msg = _decode(payload)
                except ValueError as e:  # UnicodeDecodeError is a ValueError
                    self._reject("invalid JSON", error=str(e)[:200])
                    await self._safe_send({"id": None, "error": {"code": PARSE_ERROR, "message": "invalid JSON"}})
                    continue
                await self._dispatch(msg)
        except (OSError, ConnectionError) as e:
            reason = "read failed: %s" % e
        finally:
            self._shutdown(reason)
        return reason

    async def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            self._reject("frame is not an object")
            await self._safe_send({"id": None, "error": {"code": INVALID_REQUEST, "message": "frame must be an object"}})
            return
        rid = msg.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (int, str))):
            self._reject("bad id type")
            return
        if "method" in msg:
            method = msg["method"]
            if not isinstance(method, str):
                self._reject("method is not a string")
                if rid is not None:
                    await self._safe_send({"id": rid, "error": {"code": INVALID_REQUEST, "message": "method must be a string"}})
                return
            if rid is None:
                if method == "$cancel":
                    params = msg.get("params")
                    task = self._serving.get(params.get("id") if isinstance(params, dict) else None)
                    if task is not None:
                        task.cancel()
                else:
                    self._reject("unknown notification", method=method[:100])
                return
            if rid in self._serving:
                self._reject("duplicate request id")
                return
            self._serving[rid] = asyncio.get_running_loop().create_task(self._serve_one(rid, method, msg.get("params")))
            return
        entry = self._pending.get(rid) if isinstance(rid, int) else None
        if "event" in msg:
            if entry is None:
                self._reject("event for unknown call")
            elif entry[1] is not None:
                try:
                    r = entry[1](msg["event"], msg.get("data"))
                    if asyncio.iscoroutine(r):
                        await r
                except Exception as e:
                    log("event callback failed", error=repr(e))
            return
        if "result" in msg or "error" in msg:
            if entry is None:
                self._reject("response for unknown call")
                return
            fut = entry[0]
            if fut.done():
                return
            if "error" in msg:
                err = msg["error"] if isinstance(msg["error"], dict) else {}
                code = err.get("code") if isinstance(err.get("code"), int) else INTERNAL_ERROR
                fut.set_exception(RpcError(str(err.get("message", "host error")), code, err.get("data")))
            else:
                fut.set_result(msg["result"])
            return
        self._reject("frame is neither request, event nor response")

    async def _serve_one(self, rid: Any, method: str, params: Any) -> None:
        try:
            handler = self.registry.get(method)
            if handler is None:
                await self._safe_send({"id": rid, "error": {"code": METHOD_NOT_FOUND, "message": "no method %r" % method}})
                return
            try:
                result = await handler({} if params is None else params, Context(self, rid))
            except asyncio.CancelledError:
                await self._safe_send({"id": rid, "error": {"code": CANCELLED, "message": "cancelled"}})
                return
            except RpcError as e:
                await self._safe_send({"id": rid, "error": {"code": e.code, "message": str(e), "data": e.data}})
                return
            except OSError as e:
                await self._safe_send({"id": rid, "error": {
                    "code": APPLICATION_ERROR, "message": str(e),
                    "data": {"type": type(e).__name__, "errno": e.errno}}})
                return
            except (KeyError, TypeError, ValueError) as e:
                await self._safe_send({"id": rid, "error": {"code": INVALID_PARAMS, "message": "%s: %s" % (type(e).__name__, e)}})
                return
            except Exception as e:
                log("handler failed", method=method, error=repr(e))
                await self._safe_send({"id": rid, "error": {"code": INTERNAL_ERROR, "message": "%s: %s" % (type(e).__name__, e)}})
                return
            try:
                await self.send({"id": rid, "result": result})
            except PeerClosed:
                pass
            except RpcError as e:
                await self._safe_send({"id": rid, "error": {"code": e.code, "message": str(e)}})
            except (TypeError, ValueError) as e:
                await self._safe_send({"id": rid, "error": {"code": INTERNAL_ERROR, "message": "result not JSON: %s" % e}})
        finally:
            self._serving.pop(rid, None)

    def _shutdown(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        # Requests of a host that went away are cancelled: an exec is killed, not left running unowned, and a
        # turn stops where it is (nothing of it is answered or wanted any more).
        self._abandoned = set(self._serving.values())
        for task in self._abandoned:
            task.cancel()
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerClosed(reason))
                fut.exception()
        try:
            self.writer.close()
        except Exception:
            pass
