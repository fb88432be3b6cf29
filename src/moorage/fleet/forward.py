"""Host-to-host forwarding: a request or an app WebSocket for an instance awake on another host is sent on to that host.

The request goes as it came (method, path, query, body, the caller's own credentials), so the owner authenticates
and authorises it again: forwarding grants nothing. It carries this host's trace id (``traceparent``), so the
caller's ``X-Trace-Id`` names the owner's spans too. Answers of unknown or large size (server-sent events, app
downloads) stream back as they come; WebSockets are relayed message by message. One hop only: a forwarded request
that finds the instance moved again is answered 503 with ``Retry-After`` and the client retries. An owner that
stops answering (frozen, cut off) is waited on only until its lease lapses (``OwnerLapsed``); a socket relayed to
it is closed then with 1012, to connect again.

The markers one host sets for another (``FORWARDED_BY``, ``LET_GO``, the forwarded ``traceparent``) are signed
(``FORWARD_AUTH``): an HMAC over the sender's host id, the time, the method, the path and query and the markers,
with a key derived from the installation's secrets key every host shares. A request whose signature is missing,
wrong or older than ``FORWARD_AUTH_MAX_AGE_S`` is an ordinary client request: its markers are ignored.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import socket
import ssl
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, TypeVar
from urllib.parse import unquote

import anyio
import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from moorage import clock
from moorage.aio import within
from moorage.errors import MoorageError, UnavailableError
from moorage.log import get_logger
from moorage.ws_close import (GOING_AWAY, INTERNAL, NO_STATUS, SERVICE_RESTART, TOO_BIG, caller_close,
                              sendable_close_code, sendable_reason)

log = get_logger(__name__)
T = TypeVar("T")

FORWARDED_BY = "x-moorage-forwarded-by"
SERVED_BY = "x-moorage-served-by"
#: On a forget one host sends another (``Forwarder.ask``): the receiver only lets go of the user's instances it holds
#: awake (cancels their turns, puts them to sleep) for the sender, which serves the forget (docs/fleet.md).
LET_GO = "x-moorage-let-go"
#: The sending host's signature over the markers above: ``v1.<key id>.<unix seconds>.<mac>``.
FORWARD_AUTH = "x-moorage-forward-auth"
#: A signature older (or further ahead) than this is refused: a captured one cannot be replayed later.
FORWARD_AUTH_MAX_AGE_S = 60
_FORWARD_CONTEXT = b"moorage host forwarding v1"
_AUTH = re.compile(r"^v1\.([0-9A-Za-z]{1,16})\.([0-9]{1,12})\.([0-9A-Za-z_-]{43})$")
#: Set while serving a request another host forwarded here: it must be served here, never sent on again.
forwarded: ContextVar[bool] = ContextVar("moorage_forwarded", default=False)
#: Headers that describe one connection, not the request (RFC 9110 section 7.6.1), plus those httpx sets itself;
#: ``traceparent`` is replaced by this host's own.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length", "traceparent"})
#: The markers a caller may have set itself: never sent on as the caller's (this host sets its own, signed).
_MARKERS = frozenset({FORWARDED_BY, LET_GO, FORWARD_AUTH})
#: Headers every answer of the forwarding host's server carries already.
_OWN = frozenset({"date", "server"})
#: A WebSocket handshake's own headers: the forwarding host makes its own handshake with the owner.
_HANDSHAKE = _HOP | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                     "sec-websocket-protocol", "sec-websocket-accept", "user-agent"}
#: No read timeout: how long an owner may take to answer is ``ANSWER_WAIT_S`` (its answer's head, or the whole of a
#: small one), and an answer streaming may stay silent as long as the owner's app keeps it open (a long poll). A peer
#: gone without a word is found by TCP keepalive (``_KEEPALIVE``: about a minute) and a frozen owner by its lease.
_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=5.0)
#: How long an owner has to answer (a turn runs at most 10 minutes).
ANSWER_WAIT_S = 660.0
_KEEPALIVE = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30),
              (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10), (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)]
#: Answers up to this size with a declared length are read whole and sent on as one body (every JSON route);
#: anything else (no length: server-sent events, chunked app answers; or larger) streams through.
BUFFERED_MAX = 1 << 20
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def host_tls() -> ssl.SSLContext | None:
    """What an ``https`` host_url's certificate is checked against: the CA file or directory named by
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` (a private CA, read as the CLI and the SDK read them), or None for the
    client libraries' own trust store. Proxies named in the environment are not used either way: hosts talk to each
    other directly."""
    cafile, capath = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    return ssl.create_default_context(cafile=cafile, capath=capath) if cafile or capath else None


class ForwardSigner:
    """Signs the markers of a request this host sends another and checks those of one sent here, with keys derived
    from the installation's secrets keyring (the first signs; every one is accepted, so keys rotate)."""

    def __init__(self, keys: tuple[tuple[str, bytes], ...]) -> None:
        self.keys = tuple((kid, hmac.new(key, _FORWARD_CONTEXT, hashlib.sha256).digest()) for kid, key in keys)

    @staticmethod
    def _mac(key: bytes, host: str, ts: int, method: str, path: str, query: str, let_go: str, trace: str) -> str:
        msg = "\n".join((host, str(ts), method.upper(), unquote(path), unquote(query), let_go, trace)).encode()
        return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).decode().rstrip("=")

    def sign(self, host: str, method: str, path: str, query: str, let_go: str = "", trace: str = "",
             now: float | None = None) -> str:
        kid, key = self.keys[0]
        ts = int(clock.now() if now is None else now)
        return f"v1.{kid}.{ts}.{self._mac(key, host, ts, method, path, query, let_go, trace)}"

    def verify(self, headers: Mapping[str, str], method: str, path: str, query: str,
               now: float | None = None) -> str | None:
        """The host that sent this request, when its markers carry a valid, fresh signature; else None."""
        m = _AUTH.fullmatch(headers.get(FORWARD_AUTH, "").strip())
        host = headers.get(FORWARDED_BY, "")
        if m is None or not host:
            return None
        ts = int(m.group(2))
        if abs((clock.now() if now is None else now) - ts) > FORWARD_AUTH_MAX_AGE_S:
            return None
        key = next((k for kid, k in self.keys if kid == m.group(1)), None)
        if key is None:
            return None
        want = self._mac(key, host, ts, method, path, query, headers.get(LET_GO, ""), headers.get("traceparent", ""))
        return host if hmac.compare_digest(want, m.group(3)) else None


def _signer_of(scope: Mapping[str, Any]) -> "ForwardSigner | None":
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "moorage", None)
    fleet = getattr(getattr(getattr(ctx, "runtime", None), "instances", None), "fleet", None)
    return getattr(getattr(fleet, "forwarder", None), "signer", None)


def forwarded_by(scope: dict[str, Any]) -> str | None:
    """The fleet host that forwarded this request (HTTP or WebSocket scope) here, when its signature holds; None
    for an ordinary client request, including one that sets the markers itself (ignored, logged once)."""
    state = scope.setdefault("state", {})
    if "forwarded_by" in state:
        return state["forwarded_by"]
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    host = None
    if headers.get(FORWARDED_BY):
        signer = _signer_of(scope)
        path = scope.get("path", "")
        query = (scope.get("query_string") or b"").decode("latin-1")
        method = scope.get("method", "GET")  # a WebSocket handshake is a GET
        host = signer.verify(headers, method, path, query) if signer is not None else None
        if host is None:
            log.info("a request claimed to come from another host without a valid signature: served as a client's",
                     claimed=headers.get(FORWARDED_BY)[:64], path=path[:200])
    state["forwarded_by"] = host
    return host


def forwarded_trace_id(scope: dict[str, Any]) -> str | None:
    """The trace id a forwarding host sent with a forwarded request (``traceparent``), else None.

    Only a request another host signed keeps it; any other ``traceparent`` is ignored.
    """
    if forwarded_by(scope) is None:
        return None
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    m = _TRACEPARENT.fullmatch(headers.get("traceparent", "").strip())
    return m.group(1) if m and m.group(1) != "0" * 32 else None


def _traceparent(trace_id: str | None) -> list[tuple[str, str]]:
    if not trace_id or not re.fullmatch(r"[0-9a-f]{32}", trace_id):
        return []
    import secrets

    return [("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")]


class ForwardRefused(MoorageError):
    """The owner host refused a forwarded WebSocket's handshake: its own answer goes to the caller."""

    code = "forward-refused"
    http_status = 502

    def __init__(self, response: Response) -> None:
        super().__init__(f"the owner host refused the WebSocket (HTTP {response.status_code})")
        self.response = response


class OwnerLapsed(UnavailableError):
    """The host a request was forwarded to stopped answering, and its lease lapsed while this host waited: its
    instances are anyone's to take now (a host frozen or cut off keeps the connection open, and would otherwise keep
    the caller waiting for the read timeout, eleven minutes)."""

    def __init__(self, owner_id: str) -> None:
        super().__init__(f"host {owner_id!r} stopped answering and its lease lapsed while this host waited on it",
                         hint="retry: another host takes its instances over")
        self.owner_id = owner_id


class _StreamWatch:
    """Cancels the task reading a forwarded answer's stream, while it waits on the owner's next bytes, once the
    owner's lease lapses (``fired``); the lease is looked at only while it waits, not while the caller reads."""

    def __init__(self, lapsed: Callable[[str], bool], owner_id: str, every_s: float) -> None:
        self.lapsed, self.owner_id, self.every_s = lapsed, owner_id, every_s
        self.reading = False
        self.fired = False
        self._reader = asyncio.current_task()
        self._task = asyncio.create_task(self._run(), name="forwarded-stream-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            if self.reading and await asyncio.to_thread(self.lapsed, self.owner_id) and self.reading \
                    and self._reader is not None:
                self.fired = True
                self._reader.cancel()
                return

    def stop(self) -> None:
        self._task.cancel()


class _SocketWatch:
    """Looks at the lease of each host this host relays app sockets to, once per ``every_s`` and once per host
    however many sockets go there, and sets the sockets' events when that host's lease lapses: a socket to a host
    that froze ends then, not when its pings run out (40 s). The task runs while any socket is open."""

    def __init__(self, lapsed: Callable[[str], bool], every_s: float) -> None:
        self.lapsed, self.every_s = lapsed, every_s
        self._owners: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, owner_id: str) -> asyncio.Event:
        event = asyncio.Event()
        self._owners.setdefault(owner_id, set()).add(event)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="forwarded-socket-watch")
        return event

    def remove(self, owner_id: str, event: asyncio.Event) -> None:
        events = self._owners.get(owner_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._owners[owner_id]

    async def _run(self) -> None:
        while self._owners:  # checked with no await before the return: a socket added meanwhile starts a new task
            await asyncio.sleep(self.every_s)
            for owner_id in list(self._owners):
                try:
                    gone = await asyncio.to_thread(self.lapsed, owner_id)
                except Exception as e:  # noqa: BLE001 - the store unreachable: looked at again next time
                    log.warning("could not tell whether a host's lease lapsed", owner=owner_id, error=str(e))
                    continue
                if gone:
                    log.warning("closing forwarded app sockets: their host's lease lapsed", owner=owner_id,
                                sockets=len(self._owners.get(owner_id, ())))
                    for event in self._owners.pop(owner_id, set()):
                        event.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class Forwarder:
    def __init__(self, host_id: str, signer: ForwardSigner | None = None) -> None:
        self.host_id = host_id
        #: Signs what this host sends and checks what other hosts send (None: nothing is signed or trusted).
        self.signer = signer
        #: Whether a host's lease has lapsed, as this host tells (``FleetMember.lapsed``; blocking), asked every
        #: ``watch_every_s`` while this host waits on that host's answer. None: its head waited on for ``answer_wait_s``,
        #: a streaming answer until it ends, the caller leaves or TCP keepalive finds the connection dead.
        self.lapsed: Callable[[str], bool] | None = None
        self.watch_every_s = 1.0
        self.answer_wait_s = ANSWER_WAIT_S
        self._client: httpx.AsyncClient | None = None
        self._socket_watch: _SocketWatch | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # Hosts talk to each other directly, never through a proxy named in the environment (trust_env off);
            # an https host_url is checked against SSL_CERT_FILE / SSL_CERT_DIR all the same.
            transport = httpx.AsyncHTTPTransport(verify=host_tls() or True, trust_env=False,
                                                 socket_options=_KEEPALIVE)
            self._client = httpx.AsyncClient(timeout=_TIMEOUT, follow_redirects=False, trust_env=False,
                                             transport=transport)
        return self._client

    async def _in_time(self, owner_id: str, aw: Awaitable[T]) -> T:
        """``await aw``, an owner's answer, within ``answer_wait_s`` (UnavailableError after it)."""
        try:
            return await within(aw, self.answer_wait_s)
        except TimeoutError as e:
            raise self._unreachable(owner_id, e) from e

    async def _watched(self, owner_id: str, aw: Awaitable[T]) -> T:
        """``await aw``, the owner's answer, given up (``OwnerLapsed``) once the owner's lease lapses meanwhile."""
        if self.lapsed is None:
            return await aw
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.watch_every_s)
                if done:
                    return task.result()
                if await asyncio.to_thread(self.lapsed, owner_id):
                    log.warning("gave up on a forwarded request: its host's lease lapsed", owner=owner_id)
                    raise OwnerLapsed(owner_id)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _markers(self, method: str, path: str, query: str, trace_id: str | None,
                 let_go: str = "") -> list[tuple[str, str]]:
        """This host's markers on a request it sends, signed (unsigned without a keyring: the owner ignores them)."""
        trace = _traceparent(trace_id)
        out = [(FORWARDED_BY, self.host_id), *trace] + ([(LET_GO, let_go)] if let_go else [])
        if self.signer is not None:
            out.append((FORWARD_AUTH, self.signer.sign(self.host_id, method, path, query, let_go,
                                                       trace[0][1] if trace else "")))
        return out

    def _check_hop(self, scope: dict[str, Any], owner_id: str) -> None:
        if forwarded_by(scope):
            raise UnavailableError(f"the instance moved again (now on host {owner_id!r}) while this request was forwarded",
                                   hint="retry the request")

    @staticmethod
    def _unreachable(owner_id: str, e: BaseException) -> UnavailableError:
        seen: BaseException | None = e
        while seen is not None and not isinstance(seen, ssl.SSLCertVerificationError):
            seen = seen.__cause__ or seen.__context__
        if seen is not None:  # the operator's to fix, on this host: said in its log
            log.warning("another host's certificate is not trusted here: name its CA in SSL_CERT_FILE (or "
                        "SSL_CERT_DIR) in this host's environment", owner=owner_id, error=str(seen))
        return UnavailableError(f"host {owner_id!r}, where this agent is awake, did not answer: {type(e).__name__}",
                                hint="retry; if that host is down its lease lapses and another host takes over")

    async def forward(self, request: Request, body: bytes | None, owner_id: str, owner_url: str,
                      trace_id: str | None = None) -> Response:
        """The owner's answer to ``request``. ``body`` is the request body already read, or None to stream it
        from the caller (routes that relay their body, such as an app's, have not read it). Raises
        UnavailableError when the owner cannot be reached, ``OwnerLapsed`` when its lease lapsed before it answered
        (an answer streaming already ends with an ``error`` event, when it is an event stream, once the owner's
        lease lapses while this host waits on its next bytes)."""
        self._check_hop(request.scope, owner_id)
        client = self._http()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP | _MARKERS]
        headers += self._markers(request.method, request.url.path, request.url.query, trace_id)
        content: bytes | AsyncIterator[bytes] | None = body
        declared = request.headers.get("content-length")
        if body is None and declared is not None and declared != "0":
            headers.append(("content-length", declared))  # kept: the owner's app sees the same framing
            content = request.stream()
        elif body is None and "chunked" in request.headers.get("transfer-encoding", "").lower():
            content = request.stream()
        url = owner_url.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")

        async def answer() -> tuple[httpx.Response, bool]:
            """The owner's answer: read whole (True) when it is small and of known length, else its head only."""
            try:
                upstream = await client.send(client.build_request(request.method, url, content=content,
                                                                  headers=headers), stream=True)
            except httpx.HTTPError as e:
                raise self._unreachable(owner_id, e) from e
            declared_len = upstream.headers.get("content-length")
            if declared_len is None or not declared_len.isdigit() or int(declared_len) > BUFFERED_MAX:
                return upstream, False
            try:
                await upstream.aread()
            except httpx.HTTPError as e:
                raise self._unreachable(owner_id, e) from e
            finally:
                await upstream.aclose()
            return upstream, True

        upstream, whole_read = await self._watched(owner_id, self._in_time(owner_id, answer()))
        if whole_read:
            whole = Response(upstream.content, upstream.status_code)  # its own Content-Length: decoded bytes
            whole.raw_headers += _answer_headers(upstream, owner_id, _HOP | {"content-encoding"})
            return whole
        return self._streamed(upstream, owner_id)

    def _streamed(self, upstream: httpx.Response, owner_id: str) -> Response:
        """The owner's answer as it arrives, raw (its own content encoding and length kept). When the caller goes
        away the stream is cancelled and the connection to the owner closed, which ends the owner's stream too."""
        event_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def close() -> None:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()

        def cut() -> bytes:  # the status is sent already: say it in-band, as the owner itself would
            problem = {"type": "unavailable", "status": 503, "hint": "retry the request",
                       "detail": f"host {owner_id!r} stopped answering in the middle of the stream"}
            return f"event: error\ndata: {json.dumps(problem)}\n\n".encode()

        async def body() -> AsyncIterator[bytes]:
            watch = _StreamWatch(self.lapsed, owner_id, self.watch_every_s) if self.lapsed is not None else None
            chunks = upstream.aiter_raw()
            try:
                while True:
                    if watch is not None:
                        watch.reading = True
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        if watch is not None:
                            watch.reading = False
                    yield chunk
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if watch is None or not watch.fired or me is None or me.uncancel() > 0:
                    raise  # the caller left (or the server stops), not the watch
                log.warning("gave up on a forwarded stream: its host's lease lapsed", owner=owner_id)
                if event_stream:
                    yield cut()
            except httpx.HTTPError as e:
                log.warning("forwarded stream cut", owner=owner_id, error=type(e).__name__)
                if event_stream:
                    yield cut()
            finally:
                if watch is not None:
                    watch.stop()
                await close()

        streamed = StreamingResponse(body(), upstream.status_code, background=BackgroundTask(close))
        streamed.raw_headers = _answer_headers(upstream, owner_id, _HOP - {"content-length"})
        return streamed

    async def ask(self, request: Request, owner_id: str, owner_url: str, headers: Mapping[str, str],
                  trace_id: str | None = None) -> httpx.Response:
        """Send ``owner`` the request being served here (method, path and query, no body), with the caller's own
        credentials and ``headers`` on top, marked as forwarded (so it is served there, never sent on): a step of
        the work this host does for it, such as a forget asking another holder to let go of an instance. Its
        answer is read whole. Raises UnavailableError when the owner does not answer (``OwnerLapsed`` when its
        lease lapsed meanwhile)."""
        client = self._http()
        # Not the caller's Idempotency-Key: the owner would keep this step's answer as the request's own.
        sent = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP | _MARKERS | {"idempotency-key"}]
        sent += [(k, v) for k, v in headers.items() if k.lower() != LET_GO]
        sent += self._markers(request.method, request.url.path, request.url.query, trace_id,
                              next((v for k, v in headers.items() if k.lower() == LET_GO), ""))
        url = owner_url.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            return await self._watched(owner_id, self._in_time(owner_id, client.request(request.method, url,
                                                                                      headers=sent)))
        except httpx.HTTPError as e:
            raise self._unreachable(owner_id, e) from e

    async def open_socket(self, ws: WebSocket, owner_id: str, owner_url: str, *, max_message: int,
                          open_timeout_s: float, trace_id: str | None = None) -> "ForwardedSocket":
        """A WebSocket to the owner host for the caller's ``ws`` (not yet accepted), made with the caller's own
        handshake headers and subprotocols. Raises ForwardRefused with the owner's answer when the owner refuses,
        UnavailableError when it cannot be reached."""
        self._check_hop(ws.scope, owner_id)
        base = owner_url.rstrip("/")
        base = "wss" + base[5:] if base.startswith("https") else "ws" + base[4:] if base.startswith("http") else base
        raw = ws.scope.get("raw_path") or ws.url.path.encode()
        qs = ws.scope.get("query_string") or b""
        url = base + raw.decode("latin-1") + (("?" + qs.decode("latin-1")) if qs else "")
        headers = [(k, v) for k, v in ws.headers.items() if k.lower() not in _HANDSHAKE | _MARKERS]
        headers += self._markers("GET", raw.decode("latin-1"), qs.decode("latin-1"), trace_id)
        if ws.headers.get("user-agent"):
            headers.append(("user-agent", ws.headers["user-agent"]))
        try:
            tls = host_tls() if url.startswith("wss:") else None
            conn = await connect(url, additional_headers=headers, user_agent_header=None, proxy=None,
                                 **({"ssl": tls} if tls is not None else {}),
                                 subprotocols=list(ws.scope.get("subprotocols") or []) or None,  # type: ignore[arg-type]
                                 compression=None, open_timeout=open_timeout_s, max_size=max_message,
                                 # Few messages queued from the owner: a caller that stops reading stops the owner
                                 # through TCP, and the owner stops the app the same way (docs/decisions/0012).
                                 max_queue=4, ping_interval=20, ping_timeout=20, close_timeout=10)
        except InvalidStatus as e:
            answer = e.response
            keep = {k: v for k, v in answer.headers.raw_items()
                    if k.lower() in ("content-type", "retry-after", "www-authenticate")}
            keep[SERVED_BY] = owner_id
            raise ForwardRefused(Response(answer.body or b"", answer.status_code, keep)) from None
        except (OSError, InvalidHandshake, asyncio.TimeoutError, TimeoutError) as e:
            raise self._unreachable(owner_id, e) from e
        if self.lapsed is not None and self._socket_watch is None:
            self._socket_watch = _SocketWatch(self.lapsed, self.watch_every_s)
        return ForwardedSocket(conn, owner_id, max_message, self._socket_watch)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._socket_watch is not None:
            await self._socket_watch.close()


@dataclass
class SocketOutcome:
    """How a forwarded socket ended (for the log and the span)."""

    code: int
    reason: str
    why: str
    messages_in: int = 0
    messages_out: int = 0


class ForwardedSocket:
    """A WebSocket to the owner host; ``relay`` carries the caller's messages both ways until either side closes."""

    def __init__(self, conn: ClientConnection, owner_id: str, max_message: int,
                 watch: _SocketWatch | None = None) -> None:
        self.conn = conn
        self.watch = watch
        self.owner_id = owner_id
        self.max_message = max_message
        self.subprotocol: str | None = conn.subprotocol
        #: The owner's 101 headers (the app's own) less the handshake's and those the forwarding host's server sends
        #: itself, as ``_answer_headers`` passes an HTTP answer's (the route adds ``x-moorage-served-by``).
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in conn.response.headers.raw_items()
                        if k.lower() not in _HANDSHAKE | _OWN and k.lower() != SERVED_BY]
        self.messages_in = 0
        self.messages_out = 0

    async def relay(self, ws: WebSocket) -> SocketOutcome:
        """Relay between the accepted caller ``ws`` and the owner; the side that did not close first is closed
        with the code and reason of the side that did."""
        lapsed = self.watch.add(self.owner_id) if self.watch is not None else None
        tasks = {asyncio.ensure_future(self._upstream(ws)), asyncio.ensure_future(self._downstream(ws))}
        if lapsed is not None:
            tasks.add(asyncio.ensure_future(self._lapsed(lapsed)))
        outcome = SocketOutcome(INTERNAL, "the forwarded socket failed", "error")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            try:
                outcome = next(iter(done)).result()
            except Exception as e:  # noqa: BLE001 - the socket ends; the caller gets a generic close
                log.warning("forwarded app socket failed", owner=self.owner_id, error=f"{type(e).__name__}: {e}")
        finally:
            if lapsed is not None and self.watch is not None:
                self.watch.remove(self.owner_id, lapsed)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if outcome.why == "owner-lapsed":  # a frozen owner answers no close: dropped, not waited on
                self.conn.transport.abort()
            elif outcome.why != "owner-closed":
                code, reason = caller_close(outcome.code, outcome.reason)  # a close without a code stays one
                with contextlib.suppress(Exception):
                    await within(self.conn.close(code, reason), 12)  # type: ignore[arg-type]
            if outcome.why != "caller-closed":
                with contextlib.suppress(Exception):  # a caller that reads nothing does not hold the close up
                    await within(ws.close(outcome.code, sendable_reason(outcome.reason)), 10)
        outcome.messages_in, outcome.messages_out = self.messages_in, self.messages_out
        log.info("forwarded app socket closed", owner=self.owner_id, code=outcome.code, why=outcome.why,
                 messages_in=self.messages_in, messages_out=self.messages_out)
        return outcome

    async def close_unused(self) -> None:
        with contextlib.suppress(Exception):
            await within(self.conn.close(GOING_AWAY, "the caller went away"), 12)

    @staticmethod
    async def _lapsed(event: asyncio.Event) -> SocketOutcome:
        await event.wait()
        # 1012: the caller connects again, and is served by the host that takes the agent over.
        return SocketOutcome(SERVICE_RESTART, "the host that held the agent stopped answering; connect again",
                             "owner-lapsed")

    async def _upstream(self, ws: WebSocket) -> SocketOutcome:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                # No code is ASGI's 1005 ("no status"): the owner, and so the app, is sent a close without one too.
                return SocketOutcome(int(message.get("code") or NO_STATUS), str(message.get("reason") or ""),
                                     "caller-closed")
            text = message.get("text")
            data: str | bytes = text if text is not None else (message.get("bytes") or b"")
            size = len(data.encode()) if isinstance(data, str) else len(data)
            if size > self.max_message:
                return SocketOutcome(TOO_BIG, f"messages are limited to {self.max_message} bytes", "caller-too-big")
            try:
                await self.conn.send(data)  # waits while the owner's side is not reading (backpressure)
            except ConnectionClosed as e:
                return _owner_closed(e)
            self.messages_in += 1

    async def _downstream(self, ws: WebSocket) -> SocketOutcome:
        while True:
            try:
                data = await self.conn.recv()
            except ConnectionClosed as e:
                return _owner_closed(e)
            try:
                if isinstance(data, str):
                    await ws.send_text(data)
                else:
                    await ws.send_bytes(data)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return SocketOutcome(GOING_AWAY, "the caller went away", "caller-closed")
            self.messages_out += 1


def _answer_headers(upstream: httpx.Response, owner_id: str, drop: frozenset[str]) -> list[tuple[bytes, bytes]]:
    """The owner's answer headers to send on, repeated ones (``Set-Cookie``) kept apart, plus who served it. Its
    ``Date`` and ``Server`` are not: the forwarding host's server sends its own (a second copy is a duplicate)."""
    out = [(k.lower(), v) for k, v in upstream.headers.raw
           if k.lower().decode("latin-1") not in drop | _OWN and k.lower() != SERVED_BY.encode()]
    return out + [(SERVED_BY.encode(), owner_id.encode("latin-1"))]


def _owner_closed(e: ConnectionClosed) -> SocketOutcome:
    if e.rcvd is not None:
        return SocketOutcome(sendable_close_code(e.rcvd.code), e.rcvd.reason, "owner-closed")
    if e.sent is not None and e.sent.code == TOO_BIG:
        return SocketOutcome(INTERNAL, "the agent's app sent a message over the size limit", "owner-too-big")
    return SocketOutcome(INTERNAL, "the host that holds the agent closed the connection", "owner-lost")

