"""The guest end of an agent's web app: TCP connections to 127.0.0.1:PORT inside the sandbox, relayed in frames.

Stdlib only. The host opens a connection (``app.open``), writes the request's bytes (``app.write``), pulls the
answer (``app.read``: the host asks for more only when its client took the last chunk, so a slow client never
piles bytes up in either memory) and closes it (``app.close``). No VM network is involved. A WebSocket is the
same: the host writes the upgrade and frames and keeps one ``app.read`` waiting; the relay never parses either.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from typing import Any, Dict

from . import agent
from .agent_context import put_secret_env, secret_env_names
from .rpc import INVALID_PARAMS, Context, Registry, RpcError, log

#: Connections open at once; a host that forgets to close some cannot exhaust the guest.
MAX_CONNECTIONS = 64
#: Largest chunk one ``app.read`` returns (base64 inside one frame stays far below the frame limit).
MAX_READ = 512 * 1024
#: Longest one ``app.read`` waits for bytes before answering with none (the host asks again or gives up).
READ_WAIT_S = 25.0
#: A connection nobody touched for this long is closed (a host that died mid-request leaves none behind).
IDLE_S = 300.0
#: The shortest idle time a host may ask for (``idle_s`` of ``app.open``): a WebSocket's host keeps a read
#: waiting at all times, so its connection can be dropped soon after the host stops asking (it slept, or went).
MIN_IDLE_S = 5.0
#: Whoever asks for a connection gets an error with this code when the app is not listening.
APP_UNREACHABLE = -32020
#: ... and with this one when ``MAX_CONNECTIONS`` are open to it already (the app is busy, not down).
APP_BUSY = -32021
#: ... and with this one when the agent's ``on_wake`` did not return within the wait the host allows it.
ON_WAKE_TIMEOUT = -32022
#: ... and with this one when ``on_wake`` is due and the agent opted secrets into its environment but the host sent
#: none (``secret_env``): the host asks again with them, so on_wake runs with the environment a turn gives it.
NEEDS_SECRET_ENV = -32023
#: How long ``app.open`` waits for ``on_wake`` when the host does not say (``wake_wait_s``: the agent's limits).
WAKE_WAIT_S = 10.0


class _Reader(asyncio.StreamReader):
    """A reader whose stream ends, rather than fails, when the app resets the connection: an app that answers before
    it has read the whole request (a 413 for an upload, say) and closes resets it, and its answer, already buffered
    here, must still be read out (a plain StreamReader raises the reset before the bytes it holds)."""

    def set_exception(self, exc: BaseException) -> None:
        self.feed_eof()


async def _connect(port: int) -> "tuple[asyncio.StreamReader, asyncio.StreamWriter]":
    loop = asyncio.get_running_loop()
    reader = _Reader(limit=MAX_READ, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, idle_s: float = IDLE_S) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_s = idle_s
        self.touched = time.monotonic()
        self.lock = asyncio.Lock()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


def _wake_ended(run: "asyncio.Future[None]") -> None:
    if not run.cancelled() and run.exception() is not None:
        e = run.exception()
        log("on_wake failed", error="%s: %s" % (type(e).__name__, e))


class AppRelay:
    def __init__(self) -> None:
        self._conns: Dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._reaper: "asyncio.Task[None] | None" = None
        #: The run of the agent's ``on_wake`` app requests wait for (one at a time, however many requests come).
        self._wake: "asyncio.Future[None] | None" = None

    def _get(self, params: Any) -> _Conn:
        conn = self._conns.get(params.get("conn")) if isinstance(params, dict) else None
        if conn is None:
            raise RpcError("no such app connection", INVALID_PARAMS)
        conn.touched = time.monotonic()
        return conn

    async def open(self, params: Any, ctx: Context) -> Dict[str, Any]:
        port = params.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise RpcError("port must be a TCP port number", INVALID_PARAMS)
        idle_s = params.get("idle_s", IDLE_S)
        if isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not MIN_IDLE_S <= idle_s <= IDLE_S:
            raise RpcError("idle_s must be between %g and %g seconds" % (MIN_IDLE_S, IDLE_S), INVALID_PARAMS)
        if len(self._conns) >= MAX_CONNECTIONS:
            self._reap(time.monotonic())
            if len(self._conns) >= MAX_CONNECTIONS:
                raise RpcError("too many app connections open", APP_BUSY)
        wake_wait_s = params.get("wake_wait_s", WAKE_WAIT_S)
        if isinstance(wake_wait_s, bool) or not isinstance(wake_wait_s, (int, float)) or not 0 < wake_wait_s <= 3600:
            raise RpcError("wake_wait_s must be a positive number of seconds", INVALID_PARAMS)
        await self._woken(ctx, float(wake_wait_s), params.get("secret_env"))
        try:
            async with asyncio.timeout(10):
                reader, writer = await _connect(port)
        except (OSError, asyncio.TimeoutError) as e:
            raise RpcError("nothing listens on port %d" % port, APP_UNREACHABLE, {"errno": getattr(e, "errno", None)})
        cid = next(self._ids)
        self._conns[cid] = _Conn(reader, writer, float(idle_s))
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        return {"conn": cid}

    async def _woken(self, ctx: Context, wait_s: float, secret_env: Any) -> None:
        """The agent's ``on_wake`` first, if it is due: it may be what starts the app's server again. Waited for at
        most ``wait_s``: one that takes longer goes on running, the request is refused (``ON_WAKE_TIMEOUT``) and the
        next one waits for the same run, rather than each request holding its caller until the host gave up on it.
        One that fails is logged and the request goes on (the next turn reports it; it runs again before the next).
        The secrets the agent opted into its environment are put there first, as before a turn (``secret_env``, the
        host's; asked for with ``NEEDS_SECRET_ENV``): before, an on_wake an app request ran went without them."""
        if agent.RUNTIME is None or not agent.RUNTIME.wake_due:
            return
        if self._wake is None or self._wake.done():
            loaded = next(iter(agent.RUNTIME.agents.values()), None)
            names = secret_env_names(loaded) if loaded is not None and loaded.on_wake is not None else []
            if names:
                if not isinstance(secret_env, dict):
                    raise RpcError("the agent's on_wake is due and its secrets for the environment were not sent",
                                   NEEDS_SECRET_ENV)
                put_secret_env(names, secret_env)
            self._wake = asyncio.ensure_future(agent.RUNTIME.wake_hook(ctx))
            self._wake.add_done_callback(_wake_ended)
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(self._wake)
        except TimeoutError:
            raise RpcError("the agent's on_wake did not return within %g s" % wait_s, ON_WAKE_TIMEOUT) from None
        except Exception:  # noqa: BLE001 - logged once by _wake_ended; the app request goes on
            pass

    async def write(self, params: Any, ctx: Context) -> Dict[str, Any]:
        conn = self._get(params)
        data = base64.b64decode(params.get("data") or "")
        try:
            if data:
                conn.writer.write(data)
                await conn.writer.drain()
            if params.get("eof") and conn.writer.can_write_eof():
                conn.writer.write_eof()
        except OSError as e:
            raise RpcError("the app closed the connection", APP_UNREACHABLE, {"errno": e.errno})
        return {"written": len(data)}

    async def read(self, params: Any, ctx: Context) -> Dict[str, Any]:
        conn = self._get(params)
        want = params.get("max", MAX_READ)
        if isinstance(want, bool) or not isinstance(want, int) or want < 1:
            raise RpcError("max must be a positive number of bytes", INVALID_PARAMS)
        async with conn.lock:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for read the bytes in a task of its own and, cancelled
                # as they came, handed them to a host that had gone; here a cancelled read leaves them in the buffer.
                async with asyncio.timeout(READ_WAIT_S):
                    data = await conn.reader.read(min(want, MAX_READ))
            except asyncio.TimeoutError:
                return {"data": "", "eof": False}
            except OSError:
                data = b""
        return {"data": base64.b64encode(data).decode(), "eof": not data}

    async def close(self, params: Any, ctx: Context) -> Dict[str, Any]:
        conn = self._conns.pop(params.get("conn") if isinstance(params, dict) else None, None)
        if conn is not None:
            conn.close()
        return {"closed": conn is not None}

    def _reap(self, now: float) -> None:
        for cid, conn in list(self._conns.items()):
            if now - conn.touched > conn.idle_s and not conn.lock.locked():
                self._conns.pop(cid, None)
                conn.close()
                log("app connection closed idle", conn=cid)

    async def _reap_loop(self) -> None:
        while self._conns:
            await asyncio.sleep(MIN_IDLE_S)
            self._reap(time.monotonic())


def register(registry: Registry) -> None:
    relay = AppRelay()
    registry.add("app.open", relay.open)
    registry.add("app.write", relay.write)
    registry.add("app.read", relay.read)
    registry.add("app.close", relay.close)
