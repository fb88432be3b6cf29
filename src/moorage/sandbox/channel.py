"""Host side of the host<->guest channel: length-prefixed JSON frames carrying JSON-RPC-like messages.

Bidirectional: the host calls guest methods (with streamed events and cancellation) and serves methods the
guest calls on the host. A malformed frame from the guest is logged and rejected, never raised into the host;
everything a guest can make the host hold (frames, unread events, its own requests) is bounded.
The wire format is documented in docs/channel.md; the guest has its own stdlib-only copy (guest/rpc.py). Its parts:
the frames (``channel_wire``), the host's calls as streams (``channel_calls``), serving the guest's calls
(``channel_serve``), the guest's share of the event loop (``channel_share``).
"""

from __future__ import annotations

import asyncio
import os
import inspect
import itertools
import time
from typing import Any, Awaitable, Callable, Collection

from moorage.aio import within
from moorage.log import get_logger
from moorage.sandbox.base import ChannelClosed, ChannelError, GuestProtocolError, RemoteError
from moorage.sandbox import channel_share
from moorage.sandbox.channel_calls import CallStream, Event
from moorage.sandbox.channel_serve import Handler, HandlerContext, HandlerError, Serving
from moorage.sandbox.channel_share import Share
from moorage.sandbox.channel_wire import (
    APPLICATION_ERROR,
    BUSY,
    CANCELLED,
    HEADER,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_DEPTH,
    MAX_FRAME,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    TOO_LARGE,
    decode_payload,
    encode_frame,
    json_depth_exceeds,
)

#: The channel's names, wherever they live (the frames in channel_wire, calls in channel_calls, serving in
#: channel_serve): importers name them from here.
__all__ = ["APPLICATION_ERROR", "BUSY", "CANCELLED", "INTERNAL_ERROR", "INVALID_PARAMS", "INVALID_REQUEST", "MAX_DEPTH",
           "MAX_FRAME", "MAX_GUEST_INFLIGHT", "METHOD_NOT_FOUND", "PARSE_ERROR", "TOO_LARGE", "CallStream", "Channel",
           "Event", "Handler", "HandlerContext", "HandlerError", "decode_payload", "encode_frame", "json_depth_exceeds"]

log = get_logger(__name__)

#: Guest-initiated requests served at once per channel; more are answered BUSY at once, without a task.
MAX_GUEST_INFLIGHT = 32
#: After each BUSY answer the reader pauses this long: a guest that floods is slowed to its own pace, and the
#: host's event loop stays free for other tenants (a guest within the cap never waits here).
BUSY_PAUSE_S = 0.002
#: Unread events buffered per host call (count and payload bytes). Past either the reader stops reading (the guest
#: waits: backpressure); if the caller reads nothing for EVENT_STALL_S the call fails instead.
MAX_PENDING_EVENTS = 4096
MAX_PENDING_EVENT_BYTES = 32 << 20
EVENT_STALL_S = 30.0
#: Loop time a reader may spend on frames in a row before it yields: a guest whose frames are already buffered is
#: read without the reader ever suspending, so without this one flooding guest holds the host's only event loop
#: for a whole burst and every other tenant's work waits behind it. Measured on frames, not counted in them (a
#: 4 KB event and an 8 MiB chunk cost very different time).
READ_SLICE_S = 0.0005
#: A reader's share of the host's event loop when its guest keeps it busy: it may work at full speed for a burst of
#: READ_BURST_S of loop time, then pauses so that it uses at most READ_SHARE of the loop's time. Handing the loop
#: back (READ_SLICE_S) alone is not enough: a reader that is always ready again takes a slice in every loop
#: iteration, and every other tenant's turn, a chain of awaits one iteration each, waits a slice per step.
READ_SHARE = 0.5
READ_BURST_S = 0.02
#: Frames a reader takes per second from a guest that keeps sending, after a burst of READ_BURST_FRAMES: each frame
#: costs the host more than its decoding (the socket read, the call's event queue, its consumer), and a legitimate
#: guest sends far fewer (a model's tokens, exec output, file and network chunks of up to 64 KiB).
READ_FRAMES_PER_S = 2000
READ_BURST_FRAMES = 4096
#: Ids of calls the host gave up on, remembered to drop their late answers quietly (oldest forgotten first).
_MAX_CANCELLED = 4096


class _Pending:
    __slots__ = ("events", "future", "buffered_bytes", "drained")

    def __init__(self) -> None:
        # Unbounded as a queue, bounded by the reader: it fails the call before it holds more than
        # MAX_PENDING_EVENTS events or MAX_PENDING_EVENT_BYTES of their payloads.
        self.events: asyncio.Queue[tuple[Event, int] | None] = asyncio.Queue()
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.buffered_bytes = 0
        #: Set whenever the caller has taken events (or gave up): the reader waits on it while the buffer is full.
        self.drained = asyncio.Event()

    def full(self, incoming: int = 0) -> bool:
        return self.events.qsize() >= MAX_PENDING_EVENTS or self.buffered_bytes + incoming > MAX_PENDING_EVENT_BYTES


class Channel(Serving):
    """Host end of one connection to a guest supervisor. Create with ``open_unix`` or from a stream pair."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        name: str = "channel",
        max_frame: int = MAX_FRAME,
        first_id: int = 1,
        max_guest_inflight: int = MAX_GUEST_INFLIGHT,
    ) -> None:
        self.name = name
        self.max_frame = max_frame
        self.max_guest_inflight = max_guest_inflight
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()
        #: Request ids of this connection start here; a peer that may remember an earlier connection's ids
        #: (a guest frozen by a snapshot never saw the disconnect) gets a fresh range.
        self._ids = itertools.count(first_id)
        self._pending: dict[int, _Pending] = {}
        #: Calls the host gave up on: their late events and answer are dropped quietly, not counted as rejects.
        self._cancelled: dict[int, None] = {}  # insertion-ordered set, trimmed to _MAX_CANCELLED
        self._handlers: dict[str, Handler] = {}
        self._serving: dict[Any, asyncio.Task[None]] = {}
        self._read_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._close_reason: str = "closed"
        #: Frames rejected as malformed since the channel opened (observable for tests and metrics).
        self.rejected_frames = 0
        #: Guest requests answered BUSY because ``max_guest_inflight`` were already being served.
        self.busy_rejects = 0
        #: Set when the channel closed because the guest broke the protocol (a frame that cannot be skipped):
        #: drivers stop such a guest instead of reconnecting to it.
        self.protocol_error: GuestProtocolError | None = None
        #: Called (synchronously, once) when the guest breaks the protocol: drivers stop the guest before any
        #: other task can pick the sandbox up as still running.
        self.on_protocol_error: Callable[[], None] | None = None
        #: Asked (synchronously, once) when the guest closes the connection: why, where the driver knows (its
        #: processes killed for memory), said in place of "guest closed the connection"; None: not known.
        self.why_closed: Callable[[], str | None] | None = None
        #: The budget this guest's cost to the host's event loop is charged to (its tenant's CPU share; set by
        #: the runtime): frames it sends and calls it makes are charged, and past it the reader stops reading.
        self.share: Share | None = None

    # --- construction ---------------------------------------------------------------------------------------

    @classmethod
    async def open_unix(cls, path: str, *, name: str = "channel", max_frame: int = MAX_FRAME,
                        first_id: int = 1, max_guest_inflight: int = MAX_GUEST_INFLIGHT) -> "Channel":
        dir_fd = None
        target = path
        if len(os.fsencode(path)) > 100:
            # sun_path holds ~107 bytes; reach a deeper socket through its directory's descriptor instead.
            try:
                dir_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
            except OSError as e:
                raise ChannelClosed(f"cannot connect to guest channel at {path}: {e}") from e
            target = f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}"
        try:
            reader, writer = await asyncio.open_unix_connection(target, limit=max_frame + 16)
        except OSError as e:
            raise ChannelClosed(f"cannot connect to guest channel at {path}: {e}") from e
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        ch = cls(reader, writer, name=name, max_frame=max_frame, first_id=first_id,
                 max_guest_inflight=max_guest_inflight)
        ch.start()
        return ch

    def start(self) -> None:
        if self._read_task is None:
            self._read_task = asyncio.get_running_loop().create_task(self._read_loop(), name=f"{self.name}-reader")

    # --- public API -----------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def register(self, method: str, handler: Handler) -> None:
        """Serve ``method`` for guest-originated calls: ``async def handler(params, ctx) -> result``."""
        self._handlers[method] = handler

    def unregister(self, method: str) -> None:
        """Stop serving ``method``: the guest's calls of it fail as unknown methods."""
        self._handlers.pop(method, None)

    async def call(
        self,
        method: str,
        params: Any = None,
        *,
        timeout: float | None = 30.0,
        on_event: Callable[[Event], Awaitable[None] | None] | None = None,
    ) -> Any:
        """Call a guest method and return its result; raises ``RemoteError``, ``ChannelTimeout``, ``ChannelClosed``."""
        s = CallStream(self, method, params, timeout)
        async for ev in s:
            if on_event is not None:
                r = on_event(ev)
                if inspect.isawaitable(r):
                    await r
        return s.result

    def stream(self, method: str, params: Any = None, *, timeout: float | None = None) -> CallStream:
        """Call a guest method and iterate its events; the final result is ``stream.result`` afterwards."""
        return CallStream(self, method, params, timeout)

    async def notify(self, method: str, params: Any = None) -> None:
        """Send a message that gets no response (``$cancel`` is one)."""
        await self._send({"method": method, "params": params})

    def calls_in_flight(self) -> list[int]:
        """The ids of the calls in flight now (for ``fail_calls``)."""
        return list(self._pending)

    async def fail_calls(self, error: Exception, ids: Collection[int] | None = None) -> int:
        """Fail every call in flight with ``error`` now (``ids``: only those of them still in flight), and cancel each
        in the guest; the channel stays open (the guest's late events and answers to them are dropped). Returns how
        many there were."""
        failed = [(rid, p) for rid, p in self._pending.items() if ids is None or rid in ids]
        for rid, _ in failed:
            del self._pending[rid]
        for rid, pending in failed:
            if not pending.future.done():
                pending.future.set_exception(error)
                pending.future.exception()  # mark retrieved: a caller may have given up already
            pending.events.put_nowait(None)
            pending.drained.set()
            self._forget_call(rid)
        for rid, _ in failed:
            try:
                await self.notify("$cancel", {"id": rid})
            except ChannelError:
                break
        return len(failed)

    async def close(self, reason: str = "closed by host") -> None:
        if self._read_task is not None and self._read_task is not asyncio.current_task():
            self._read_task.cancel()
        self._shutdown(reason)
        try:
            self._writer.close()
            await within(self._writer.wait_closed(), 2)
        except (OSError, asyncio.TimeoutError, RuntimeError):
            pass

    # --- internals ------------------------------------------------------------------------------------------

    async def _start_call(self, method: str, params: Any) -> tuple[int, _Pending]:
        if self.closed:
            raise ChannelClosed(f"{self.name} is closed ({self._close_reason})", hint="wake or restart the sandbox")
        rid = next(self._ids)
        pending = _Pending()
        self._pending[rid] = pending
        try:
            await self._send({"id": rid, "method": method, "params": {} if params is None else params})
        except BaseException:
            self._pending.pop(rid, None)
            raise
        return rid, pending

    async def _send(self, msg: dict[str, Any]) -> None:
        frame = encode_frame(msg, self.max_frame)
        if self.closed:
            raise ChannelClosed(f"{self.name} is closed ({self._close_reason})", hint="wake or restart the sandbox")
        async with self._write_lock:
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (OSError, RuntimeError) as e:
                self._shutdown(f"write failed: {e}")
                raise ChannelClosed(f"{self.name}: write failed: {e}") from e

    def _reject(self, why: str, **fields: Any) -> None:
        self.rejected_frames += 1
        # A flooding guest must not flood the host's log too: the first few, then one line per thousand.
        if self.rejected_frames <= 20 or self.rejected_frames % 1000 == 0:
            log.warning("rejected guest frame", channel=self.name, reason=why, rejected=self.rejected_frames, **fields)

    async def _read_loop(self) -> None:
        reason = "guest closed the connection"
        clock = time.perf_counter
        used = 0.0  # loop time spent on frames since the reader last yielded
        budget, mark = READ_BURST_S, clock()  # loop time it may still use at full speed; refilled at READ_SHARE
        frames, frame_budget = 0, float(READ_BURST_FRAMES)  # the same for frames, refilled at READ_FRAMES_PER_S
        try:
            while True:
                share = self.share
                if share is not None and (wait := share.wait_s()) > 0:
                    # Overspent: the guest's frames wait in its socket until its share has refilled.
                    await asyncio.sleep(min(wait, channel_share.MAX_WAIT_S))
                if used >= READ_SLICE_S or frames >= 64:
                    now = clock()
                    budget = min(READ_BURST_S, budget + (now - mark) * READ_SHARE) - used
                    frame_budget = min(READ_BURST_FRAMES, frame_budget + (now - mark) * READ_FRAMES_PER_S) - frames
                    mark, used, frames = now, 0.0, 0
                    # Buffered frames are read without suspending: let other tasks run, and past its burst wait
                    # until its share has refilled what it overspent (the guest meanwhile waits: backpressure).
                    await asyncio.sleep(max(0.0, -budget / READ_SHARE, -frame_budget / READ_FRAMES_PER_S))
                try:
                    header = await self._reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    break
                (length,) = HEADER.unpack(header)
                if length == 0 or length > self.max_frame:
                    # The stream cannot be resynchronised after a bad length: drop the connection.
                    self._reject("bad frame length", length=length, max_frame=self.max_frame)
                    reason = f"guest sent a frame of {length} bytes (limit {self.max_frame})"
                    self._shutdown(reason, error=GuestProtocolError(f"{self.name}: {reason}"))
                    return
                try:
                    payload = await self._reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    reason = "guest closed the connection mid-frame"
                    break
                started, cpu = clock(), time.thread_time()
                frames += 1
                try:
                    msg = decode_payload(payload)
                except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors too
                    self._reject("invalid JSON", error=str(e)[:200])
                    await self._safe_send({"id": None, "error": {"code": PARSE_ERROR, "message": f"invalid JSON: {str(e)[:200]}"}})
                    used += clock() - started
                    if share is not None:
                        share.charge(time.thread_time() - cpu)
                    continue
                del payload
                try:
                    await self._dispatch(msg, length)
                except (asyncio.CancelledError, OSError, ConnectionError):
                    raise
                except Exception as e:  # a frame must never kill the reader: the guest cannot take the host down
                    self._reject("frame could not be handled", error=f"{type(e).__name__}: {str(e)[:200]}")
                used += clock() - started
                if share is not None:
                    share.charge(time.thread_time() - cpu)
        except asyncio.CancelledError:
            reason = "closed by host"
            raise
        except (OSError, ConnectionError) as e:
            reason = f"read failed: {e}"
        finally:
            if reason.startswith("guest closed the connection") and self.why_closed is not None:
                try:
                    reason = self.why_closed() or reason
                except Exception:  # the driver's explanation must not break the shutdown of the channel
                    log.exception("close explanation failed", channel=self.name)
            self._shutdown(reason)

    async def _safe_send(self, msg: dict[str, Any]) -> None:
        try:
            await self._send(msg)
        except ChannelError:
            pass

    def _forget_call(self, rid: int) -> None:
        self._cancelled[rid] = None
        while len(self._cancelled) > _MAX_CANCELLED:
            del self._cancelled[next(iter(self._cancelled))]

    async def _dispatch(self, msg: Any, size: int = 0) -> None:
        if not isinstance(msg, dict):
            self._reject("frame is not a JSON object")
            await self._safe_send({"id": None, "error": {"code": INVALID_REQUEST, "message": "frame must be an object"}})
            return
        rid = msg.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (int, str))):
            self._reject("bad id type", id=repr(rid)[:50])
            return
        if "method" in msg:
            method = msg["method"]
            if not isinstance(method, str):
                self._reject("method is not a string")
                if rid is not None:
                    await self._safe_send({"id": rid, "error": {"code": INVALID_REQUEST, "message": "method must be a string"}})
                return
            if rid is None:
                self._on_notification(method, msg.get("params"))
            elif rid in self._serving:
                self._reject("duplicate request id", id=repr(rid)[:50])
            elif len(self._serving) >= self.max_guest_inflight:
                # Answered inline (no task): a flood costs the host one small frame per request, never memory.
                self.busy_rejects += 1
                await self._safe_send({"id": rid, "error": {
                    "code": BUSY, "message": f"host is serving {self.max_guest_inflight} requests of this sandbox; retry later",
                    "data": {"type": "Busy", "limit": self.max_guest_inflight}}})
                await asyncio.sleep(BUSY_PAUSE_S)
            else:
                self._on_request(rid, method, msg.get("params"), size)
            return
        if isinstance(rid, int) and rid in self._cancelled:
            if "result" in msg or "error" in msg:
                self._cancelled.pop(rid, None)
            return
        if "event" in msg:
            pending = self._pending.get(rid) if isinstance(rid, int) else None
            if pending is None or not isinstance(msg["event"], str):
                self._reject("event for unknown call", id=repr(rid)[:50])
                return
            if pending.full(size):
                # Backpressure: stop reading until the caller takes events; the guest's writes then wait too.
                pending.drained.clear()
                try:
                    await within(pending.drained.wait(), EVENT_STALL_S)
                except asyncio.TimeoutError:
                    pass
                if self._pending.get(rid) is not pending:
                    return  # the caller gave up on the call meanwhile: its late events are dropped
            if pending.full(size):
                # The caller read nothing for EVENT_STALL_S: fail this call rather than buffer without end.
                self._reject("too many unread events", id=repr(rid)[:50])
                self._pending.pop(rid, None)
                self._forget_call(rid)
                if not pending.future.done():
                    pending.future.set_exception(GuestProtocolError(
                        f"{self.name}: the guest streamed more than {MAX_PENDING_EVENTS} events or "
                        f"{MAX_PENDING_EVENT_BYTES >> 20} MiB that nobody read for {EVENT_STALL_S:g} s",
                        hint="the call was cancelled; read events as they come or ask for less output"))
                    pending.future.exception()  # mark retrieved: the caller may be gone for good
                pending.events.put_nowait(None)
                await self._safe_send({"method": "$cancel", "params": {"id": rid}})
                return
            pending.buffered_bytes += size
            pending.events.put_nowait((Event(msg["event"], msg.get("data")), size))
            return
        if "result" in msg or "error" in msg:
            pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if pending is None:
                self._reject("response for unknown call", id=repr(rid)[:50])
                return
            if "error" in msg:
                err = msg["error"] if isinstance(msg["error"], dict) else {}
                code = err.get("code") if isinstance(err.get("code"), int) else INTERNAL_ERROR
                pending.future.set_exception(
                    RemoteError(str(err.get("message", "guest error"))[:2000], rpc_code=code, data=err.get("data"))
                )
            else:
                pending.future.set_result(msg["result"])
            pending.events.put_nowait(None)
            return
        self._reject("frame is neither request, event nor response")

    def _shutdown(self, reason: str, error: ChannelError | None = None) -> None:
        if self._closed.is_set():
            return
        self._close_reason = reason
        if isinstance(error, GuestProtocolError):
            self.protocol_error = error
        self._closed.set()
        if self.protocol_error is not None and self.on_protocol_error is not None:
            try:
                self.on_protocol_error()
            except Exception:  # the driver's reaction must not break the shutdown of the channel
                log.exception("protocol-error callback failed", channel=self.name)
        exc = error or ChannelClosed(f"{self.name} closed: {reason}", hint="wake or restart the sandbox")
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(exc)
                pending.future.exception()  # mark retrieved: a caller may have given up already
            pending.events.put_nowait(None)
            pending.drained.set()
        self._pending.clear()
        for task in self._serving.values():
            task.cancel()
        try:
            self._writer.close()
        except (OSError, RuntimeError):
            pass
        log.debug("channel closed", channel=self.name, reason=reason)
