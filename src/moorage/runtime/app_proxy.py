"""An agent's own web app over HTTP: one request framed (h11) and relayed to the app's port in the user's sandbox,
its answer parsed, capped and rewritten on the way back (the port: ``app_guest.py``; errors: ``app_errors.py``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import h11

from moorage.errors import InvalidInput
from moorage.log import get_logger
from moorage.runtime.app_errors import AppTooLarge, AppUnavailable, live_channel
from moorage.runtime.app_guest import (DROP_REQUEST, DROP_RESPONSE, READ_CHUNK, WRITE_CHUNK, app_of, open_connection,
                                       origin_for, own_origin)
from moorage.sandbox import ChannelError, ChannelTimeout, RemoteError
from moorage.store import TenantStore

log = get_logger(__name__)

#: A response head larger than this is refused (h11 keeps it in memory until it is complete).
MAX_HEAD_BYTES = 64 * 1024

#: Served on the API's origin, the app's pages get a sandboxed origin of their own: their scripts cannot read
#: the dashboard's storage or call the API with the visitor's credentials.
APP_CSP = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"


@dataclass
class AppRequest:
    method: str
    #: Path and query as the app should see them (``/x?y=1``), raw (percent-encoded) bytes.
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: AsyncIterator[bytes]
    #: Where the app is mounted on the API (sent as ``X-Forwarded-Prefix``).
    prefix: str


@dataclass
class AppResponse:
    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]
    #: Ends the exchange early (the caller went away); the body iterator does this itself when it finishes.
    aclose: Callable[[], Awaitable[None]]


def _limits(config: Any) -> tuple[int, int, float, float]:
    return (config.app_max_request_bytes, config.app_max_response_bytes, float(config.app_timeout_s),
            float(config.app_max_duration_s))


def _request_head(req: AppRequest, port: int) -> tuple[h11.Request, bool]:
    if not req.target.startswith(b"/") or any(c <= 0x20 or c == 0x7f for c in req.target):
        raise InvalidInput("malformed path for the agent's app")
    headers = [(k, v) for k, v in req.headers if k.lower().decode("latin-1") not in DROP_REQUEST]
    declared = next((v for k, v in req.headers if k.lower() == b"content-length"), None)
    chunked = any(k.lower() == b"transfer-encoding" for k, _ in req.headers)
    if declared is not None:
        if not declared.isdigit():
            raise InvalidInput("malformed Content-Length")
        headers.append((b"content-length", declared))
    elif chunked:
        headers.append((b"transfer-encoding", b"chunked"))
    headers += [(b"host", f"127.0.0.1:{port}".encode()), (b"connection", b"close"),
                (b"x-forwarded-prefix", req.prefix.encode()), (b"x-forwarded-proto", b"http")]
    headers += [(b"origin", origin.encode()) for origin in origin_for(req.headers, port)]
    try:
        return h11.Request(method=req.method.encode(), target=req.target, headers=headers), declared is not None or chunked
    except h11.LocalProtocolError as e:
        raise InvalidInput(f"the request cannot be passed to the agent's app: {e}") from None


class _AppStoppedReading(AppUnavailable):
    """The app closed its side while the request was still being written (it may have answered already)."""


class _Exchange:
    """One request/response over one relayed guest connection."""

    def __init__(self, sandbox: Any, conn_id: int, deadline: float, max_response: int, write_timeout_s: float) -> None:
        self.sandbox = sandbox
        self.conn_id = conn_id
        self.deadline = deadline
        #: How long one write may wait for the app to take its bytes (the guest's write waits on the app's socket).
        self.write_timeout_s = write_timeout_s
        self.max_response = max_response
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.received = 0
        self.closed = False

    async def write(self, data: bytes) -> None:
        for i in range(0, len(data), WRITE_CHUNK):
            until = min(self.deadline, time.monotonic() + self.write_timeout_s)
            try:
                await self._call("app.write", {"conn": self.conn_id,
                                               "data": base64.b64encode(data[i:i + WRITE_CHUNK]).decode()}, until)
            except AppUnavailable as e:
                if isinstance(e.__cause__, RemoteError):
                    raise _AppStoppedReading(e.message, hint=e.hint) from e.__cause__
                if isinstance(e.__cause__, ChannelTimeout) and until < self.deadline:
                    raise AppUnavailable("the agent's app stopped reading the request",
                                         hint="make the app read its requests sooner, or raise app_timeout_s") from None
                raise

    async def _call(self, method: str, params: dict[str, Any], until: float | None = None) -> Any:
        left = (until or self.deadline) - time.monotonic()
        if left <= 0:
            raise AppUnavailable("the agent's app took too long to answer", hint="make the app answer sooner")
        try:
            return await self.sandbox.channel.call(method, params, timeout=min(left, 35.0))
        except RemoteError as e:
            raise AppUnavailable("the agent's app closed the connection",
                                 hint="check the app's own log in the sandbox") from e
        except ChannelError as e:
            if time.monotonic() >= (until or self.deadline):
                raise AppUnavailable("the agent's app took too long to answer", hint="make the app answer sooner") from e
            raise AppUnavailable("the sandbox stopped answering", hint="retry; the agent's instance may be restarting") from e

    async def next_event(self, until: float) -> Any:
        """The next parsed event, reading from the guest as needed (its answers are checked by h11)."""
        while True:
            try:
                ev = self.h11.next_event()
            except h11.RemoteProtocolError:
                raise AppUnavailable("the agent's app sent a malformed HTTP response",
                                     hint="serve HTTP/1.1 on the declared port") from None
            if ev is not h11.NEED_DATA:
                return ev
            while True:
                got = await self._call("app.read", {"conn": self.conn_id, "max": READ_CHUNK}, until)
                data = base64.b64decode(got.get("data") or "") if isinstance(got, dict) else b""
                if data or (isinstance(got, dict) and got.get("eof")):
                    break
                # An empty read without eof: the guest waited its longest; ask again until the deadline.
            self.received += len(data)
            if self.received > self.max_response + MAX_HEAD_BYTES:
                raise AppTooLarge(f"the agent's app answered with more than {self.max_response} bytes",
                                  hint="serve smaller responses, or raise app_max_response_bytes")
            self.h11.receive_data(data)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self.sandbox.channel.call("app.close", {"conn": self.conn_id}, timeout=5)


async def app_request(runtime: Any, ts: TenantStore, agent_name: str, user: str, req: AppRequest) -> AppResponse:
    """Relay ``req`` to the app of ``user``'s instance of ``agent_name`` in tenant ``ts``, waking it if asleep.

    The instance is woken like for a turn and held awake while the exchange lasts; bytes travel over the host↔guest
    channel (``guest/app_relay.py``), never a VM network. The guest is untrusted: both bodies are capped, every wait
    has a deadline, and what goes wrong is a generic error.

    Raises NotFound (no such agent or user, or the agent serves no app), AppUnavailable (502), AppBusy (503), AppTooLarge
    (413). The response body must be consumed or ``aclose``d: the instance stays awake until then.
    """
    max_request, max_response, head_timeout, max_duration = _limits(runtime.config)
    agent, lc, scope, deployment, port = await app_of(runtime, ts, agent_name, user)
    head, has_body = _request_head(req, port)

    async def template() -> Any:
        return await runtime._template_for(ts, agent)

    stack = contextlib.AsyncExitStack()
    started = time.monotonic()
    deadline = started + max_duration
    exchange: _Exchange | None = None
    try:
        # Held like a turn: the instance is woken once however many requests arrive, and never slept meanwhile.
        sandbox = await stack.enter_async_context(runtime.instances.turn(ts, scope, template, lifecycle=lc))
        from moorage.runtime.vm_network import attach

        def network(channel: Any) -> None:  # its own network, on each connection
            attach(runtime, sandbox.id, channel, ts, agent_name, user, deployment.manifest)

        network(live_channel(sandbox))
        opened = await open_connection(runtime, sandbox, deployment, port, ts=ts, agent_name=agent_name, user=user,
                                        on_restart=network)
        exchange = _Exchange(sandbox, int(opened["conn"]), deadline, max_response, head_timeout)
        stack.push_async_callback(exchange.close)
        try:
            await _send_request(exchange, head, req.body if has_body else None, max_request)
        except _AppStoppedReading:
            pass  # an app may answer before it has read the whole body (a 413, a 401) and close: its answer is relayed
        head_until = min(deadline, time.monotonic() + head_timeout)
        while True:
            ev = await exchange.next_event(head_until)
            if isinstance(ev, h11.InformationalResponse):
                continue  # 100 Continue and the like: the host already sent the whole body
            if isinstance(ev, h11.Response):
                break
            raise AppUnavailable("the agent's app closed the connection before answering",
                                 hint="check the app's own log in the sandbox")
        declared = next((v for k, v in ev.headers if k == b"content-length"), None)
        if declared is not None and int(declared) > max_response:
            raise AppTooLarge(f"the agent's app answered with {int(declared)} bytes; the limit is {max_response}",
                              hint="serve smaller responses, or raise app_max_response_bytes")
        headers = _response_headers(ev.headers, port, req)
        status = ev.status_code
    except BaseException:
        await stack.aclose()
        raise

    ex = exchange
    assert ex is not None

    def close_behind() -> None:
        # Cut short: cleanup must not wait on a cancelled caller, so the guest connection is closed and the
        # instance released in the background, by a task held until done.
        task = asyncio.ensure_future(stack.aclose())
        _CLEANUPS.add(task)
        task.add_done_callback(_cleaned)

    async def body() -> AsyncIterator[bytes]:
        # One chunk is held back: the instance is released before the caller has the last bytes, so whoever
        # acts on a complete answer (and sleeps the instance, say) never finds it still busy.
        held = b""
        try:
            while True:
                item = await _unless_stopping(ex.next_event(deadline), runtime.stopping)
                if item is _STOPPING:
                    break
                if isinstance(item, h11.Data):
                    if held:
                        yield held
                    held = bytes(item.data)
                elif isinstance(item, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        except BaseException:
            close_behind()  # the caller went away, a limit
            raise
        if item is _STOPPING:
            # The host is stopping: an answer with no end of its own (an event stream) would hold the server's
            # graceful stop for up to app_max_duration_s. What came is sent, and the answer ends here.
            close_behind()
            if held:
                yield held
            return
        await stack.aclose()
        if held:
            yield held

    log.info("app request", agent=agent_name, status=status, ms=int((time.monotonic() - started) * 1000))
    return AppResponse(status, headers, body(), stack.aclose)


async def _send_request(exchange: _Exchange, head: h11.Request, body: AsyncIterator[bytes] | None,
                        max_request: int) -> None:
    await exchange.write(exchange.h11.send(head))
    sent = 0
    if body is not None:
        async for chunk in body:
            sent += len(chunk)
            if sent > max_request:
                raise AppTooLarge(f"the request body is over {max_request} bytes",
                                  hint="send a smaller body, or raise app_max_request_bytes")
            if chunk:
                try:
                    await exchange.write(exchange.h11.send(h11.Data(data=chunk)))
                except h11.LocalProtocolError:
                    raise InvalidInput("the request body does not match its Content-Length") from None
    try:
        await exchange.write(exchange.h11.send(h11.EndOfMessage()))
    except h11.LocalProtocolError:
        raise InvalidInput("the request body does not match its Content-Length") from None


_CLEANUPS: set["asyncio.Future[None]"] = set()

#: What ``_unless_stopping`` returns once the host's stop has begun.
_STOPPING: Any = object()


async def _unless_stopping(step: Awaitable[Any], stopping: asyncio.Event) -> Any:
    """``step``'s result, or ``_STOPPING`` (``step`` cancelled) if the host's stop begins first."""
    if stopping.is_set():
        step.close()  # type: ignore[attr-defined]  # a coroutine never started
        return _STOPPING
    nxt = asyncio.ensure_future(step)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((nxt, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not nxt.done():
            nxt.cancel()
            nxt.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it now
    return nxt.result() if nxt.done() and not nxt.cancelled() else _STOPPING


def _mounted(location: str, port: int, prefix: str) -> str:
    """A redirect to the app's own address (frameworks make one absolute from the ``Host`` it was sent) points
    where the app is mounted instead; any other location is the app's to choose."""
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        if location == origin or location.startswith((origin + "/", origin + "?")):
            rest = location[len(origin):]
            return prefix + (rest if rest.startswith("/") else "/" + rest)
    return location


def _cleaned(task: "asyncio.Future[None]") -> None:
    _CLEANUPS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("app exchange cleanup failed", error=str(task.exception()))


def _response_headers(raw: Iterable[tuple[bytes, bytes]], port: int, req: AppRequest) -> list[tuple[str, str]]:
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.decode("latin-1") not in DROP_RESPONSE]
    out = [(k, _mounted(v, port, req.prefix) if k == "location" else v) for k, v in out]
    origin = next((v.decode("latin-1") for k, v in req.headers if k.lower() == b"origin"), None)
    if origin is not None:
        # The app allows the origin it was sent (its own, origin_for): that is the caller's (CORS that reflects it).
        out = [(k, origin if k == "access-control-allow-origin" and v == own_origin(port) else v) for k, v in out]
    out.append(("content-security-policy", APP_CSP))
    out.append(("x-content-type-options", "nosniff"))
    out.append(("referrer-policy", "no-referrer"))  # a share link's token never leaves in a Referer
    return out
