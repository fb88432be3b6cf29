"""WebSockets to an agent's own app: the upgrade relayed to the app's port inside the user's sandbox, then messages
both ways, over one relayed guest connection (``guest/app_relay.py`` carries raw bytes and parses nothing).

The host speaks WebSocket to the app itself (the ``websockets`` sans-I/O client): it checks the app's handshake and
frames, caps every message, and pulls the app's bytes only as the caller takes them. A socket does not pin the
instance awake: its messages count as activity, and when the instance sleeps the socket is closed (1001).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Iterator, Protocol

from websockets.client import ClientProtocol
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import SEND_EOF, State
from websockets.uri import parse_uri

from moorage.aio import within
from moorage.errors import InvalidInput, MoorageError
from moorage.log import get_logger
from moorage.runtime.app_errors import AppUnavailable, live_channel
from moorage.runtime.app_guest import DROP_REQUEST, DROP_RESPONSE, app_of, open_connection, origin_for
from moorage.runtime.app_socket_conn import GUEST_IDLE_S, AppStalled, GuestConnection, InstanceGone, too_slow
from moorage.store import TenantStore
from moorage.ws_close import (GOING_AWAY, INTERNAL, NORMAL, SERVICE_RESTART, TOO_BIG, caller_close,
                              sendable_close_code)

log = get_logger(__name__)

#: The caller's handshake headers the app never sees besides the HTTP ones: the host makes its own handshake.
_DROP_HANDSHAKE = DROP_REQUEST | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                                   "sec-websocket-protocol", "sec-websocket-accept"}
#: The app's 101 headers the caller never gets besides an HTTP answer's: the host's server makes its own handshake
#: (the subprotocol the app chose is accepted as such, ``AppSocket.subprotocol``).
_DROP_SWITCH = DROP_RESPONSE | {"sec-websocket-accept", "sec-websocket-protocol", "sec-websocket-extensions",
                                "sec-websocket-version", "content-length"}


class AppSocketRefused(MoorageError):
    """The agent's app answered the WebSocket handshake with something other than a switch to WebSocket."""

    code = "app-socket-refused"
    http_status = 502


class AppSocketsExhausted(MoorageError):
    """This instance already has as many WebSockets open as the host allows (``app_ws_max_sockets``)."""

    code = "app-sockets-exhausted"
    http_status = 429


@dataclass
class CallerClose:
    """The caller closed its socket with this code (passed on to the app; ``ws_close.NO_STATUS`` as an empty close
    frame)."""

    code: int = NORMAL
    reason: str = ""


class CallerSocket(Protocol):
    """The caller's end, as the API layer hands it over (already accepted)."""

    async def receive(self) -> str | bytes | CallerClose:
        """The caller's next message, or how it closed."""

    async def send(self, message: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


@dataclass
class AppSocketRequest:
    #: Path and query as the app should see them (``/ws?x=1``), raw (percent-encoded) bytes.
    target: bytes
    headers: list[tuple[bytes, bytes]]
    #: Subprotocols the caller offers, offered to the app as they are.
    subprotocols: list[str]
    #: Where the app is mounted on the API (sent as ``X-Forwarded-Prefix``).
    prefix: str


@dataclass
class Outcome:
    """How a socket ended: the close the caller gets and why (for the log and the span)."""

    code: int
    reason: str
    why: str


_OPEN: dict[str, int] = {}  # sandbox id -> sockets open on this host


@dataclass
class AppSocket:
    """An open WebSocket to the app; ``relay`` carries messages between it and the caller until either ends."""

    runtime: Any
    ts: TenantStore
    scope: Any
    sandbox: Any
    channel: Any
    conn: GuestConnection
    protocol: ClientProtocol
    #: The subprotocol the app chose (accept the caller with it).
    subprotocol: str | None
    max_message: int
    #: Frames that arrived with the app's handshake answer.
    early: list[Any] = field(default_factory=list)
    #: The app's own headers on its 101 (accept the caller with them), as an HTTP answer's pass.
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    messages_in: int = 0
    messages_out: int = 0

    def __post_init__(self) -> None:
        self._write_lock = asyncio.Lock()
        self._released = False

    async def relay(self, caller: CallerSocket, ended: Awaitable[Outcome] | None = None) -> Outcome:
        """Carry messages both ways until the caller or the app closes, a limit is passed, the instance sleeps or
        ``ended`` (the caller's credential revoked or expired) gives the outcome; the caller is closed with the
        outcome's code (the caller's own close is not answered again)."""
        tasks = {asyncio.ensure_future(self._upstream(caller)): "up", asyncio.ensure_future(self._downstream(caller)): "down",
                 asyncio.ensure_future(self._watch()): "watch"}
        if ended is not None:
            tasks[asyncio.ensure_future(ended)] = "credential"
        outcome = Outcome(INTERNAL, "the socket to the agent's app failed", "error")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(done))
            try:
                outcome = first.result()
            except InstanceGone:
                outcome = self._gone()
            except AppStalled:  # not a sleep: the instance is awake, its app is busy elsewhere or hung
                outcome = Outcome(INTERNAL, "the agent's app stopped reading the socket", "app-stalled")
            except Exception as e:  # noqa: BLE001 - the socket ends; the caller gets a generic close
                log.warning("app socket failed", error=f"{type(e).__name__}: {e}")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._finish(outcome)
            if outcome.why != "caller-closed":
                with contextlib.suppress(Exception):  # a caller that reads nothing does not hold the close up
                    await within(caller.close(outcome.code, outcome.reason), 10)
        log.info("app socket closed", code=outcome.code, why=outcome.why, messages_in=self.messages_in,
                 messages_out=self.messages_out)
        return outcome

    async def close_unused(self) -> None:
        """Release a socket that will never be relayed (the caller went away before it was accepted)."""
        await self._finish(Outcome(GOING_AWAY, "the caller went away", "error"))

    # -- the two directions --------------------------------------------------------------------------------------

    async def _upstream(self, caller: CallerSocket) -> Outcome:
        while True:
            message = await caller.receive()
            if isinstance(message, CallerClose):
                return Outcome(message.code, message.reason, "caller-closed")
            data = message.encode() if isinstance(message, str) else message
            if len(data) > self.max_message:
                return Outcome(TOO_BIG, f"messages are limited to {self.max_message} bytes", "caller-too-big")
            with self._active():
                # Busy while the message is written: the instance is not put to sleep with half of it sent.
                if isinstance(message, str):
                    self.protocol.send_text(data)
                else:
                    self.protocol.send_binary(data)
                await self._flush()
            self.messages_in += 1

    async def _downstream(self, caller: CallerSocket) -> Outcome:
        parts: list[bytes] = []
        kind: Opcode | None = None
        events = self.early
        self.early = []
        while True:
            for ev in events:
                if not isinstance(ev, Frame):
                    continue
                if ev.opcode is Opcode.CLOSE:
                    await self._flush()  # the protocol's answering close frame
                    rcvd = self.protocol.close_rcvd
                    code = sendable_close_code(rcvd.code) if rcvd is not None else NORMAL
                    return Outcome(code, rcvd.reason if rcvd is not None else "", "app-closed")
                if ev.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, parts = ev.opcode, [ev.data]
                elif ev.opcode is Opcode.CONT:
                    parts.append(ev.data)
                else:
                    continue  # ping (answered by the protocol, sent below) or pong
                if ev.fin:
                    data, parts = b"".join(parts), []
                    self._touch()
                    try:
                        await caller.send(data.decode() if kind is Opcode.TEXT else data)
                    except UnicodeDecodeError:
                        return Outcome(INTERNAL, "the agent's app sent text that is not UTF-8", "app-broke")
                    self.messages_out += 1
            await self._flush()
            failed = self._failure()
            if failed is not None:
                return failed
            data = await self.conn.read()
            if data is None:
                return Outcome(INTERNAL, "the agent's app closed the connection", "app-eof")
            self.protocol.receive_data(data)
            events = self.protocol.events_received()

    def _gone(self) -> Outcome:
        """Why the instance's channel went away: a sleep takes the sandbox from the instance before it closes the
        channel, so a channel that closed under an instance still holding this sandbox stopped by itself, or was
        restarted by a redeploy (its new packages or environment: ``instance_update``), which a client reconnects
        after (1012, service restart)."""
        from moorage.runtime import instance_update

        li = self.runtime.instances.live(self.ts, self.scope)
        if li is not None and li.sandbox is self.sandbox:
            if instance_update.changing(self.sandbox.id):
                return Outcome(SERVICE_RESTART, "the agent was redeployed; reconnect", "redeployed")
            return Outcome(INTERNAL, "the agent's instance stopped", "stopped")  # a crash: the app took it down, say
        return Outcome(GOING_AWAY, "the agent's instance went to sleep", "asleep")

    def _failure(self) -> Outcome | None:
        """The protocol gave up on the app (a message over the limit, a frame that breaks the protocol)."""
        sent = self.protocol.close_sent
        if sent is None or self.protocol.close_rcvd is not None:
            return None
        if sent.code == TOO_BIG:
            return Outcome(INTERNAL, f"the agent's app sent a message over {self.max_message} bytes", "app-too-big")
        return Outcome(INTERNAL, "the agent's app broke the WebSocket protocol", "app-broke")

    async def _watch(self) -> Outcome:
        """Ends when the instance stops being this sandbox (it went to sleep) or its channel closes, or, in a fleet,
        when this host has been cut off from the store for nearly a lease: another host may take the instance over
        then, and the caller, connecting again, reaches it (1012) instead of this copy."""
        fleet = getattr(self.runtime.instances, "fleet", None)
        closed = asyncio.ensure_future(self.channel.wait_closed())
        try:
            while not closed.done() and self._awake():
                if fleet is not None and not fleet.holds_own_lease():
                    log.warning("closing an app socket: this host lost touch with the store for nearly a lease")
                    return Outcome(SERVICE_RESTART, "this host lost touch with the agent's store; connect again",
                                   "lease-lost")
                await asyncio.wait({closed}, timeout=0.25)
        finally:
            closed.cancel()
        raise InstanceGone()

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _awake(self) -> bool:
        li = self.runtime.instances.live(self.ts, self.scope)
        return (li is not None and li.sandbox is self.sandbox and self.sandbox.channel is self.channel
                and not self.channel.closed)

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        """Counts as a turn for the instance's lifecycle while the block runs (it is not slept meanwhile)."""
        if not self._awake():
            raise InstanceGone()
        li = self.runtime.instances.live(self.ts, self.scope)
        clock = self.runtime.instances.clock
        li.activity.turn_started(clock())
        try:
            yield
        finally:
            li.activity.turn_ended(clock())

    def _touch(self) -> None:
        """A message from the app is activity too: the instance's idle time starts again."""
        if self._awake():
            with self._active():
                pass

    async def _flush(self) -> None:
        async with self._write_lock:
            out = self.protocol.data_to_send()
            data = b"".join(out)
            if data or SEND_EOF in out:
                await self.conn.write(data, eof=SEND_EOF in out)

    async def _finish(self, outcome: Outcome) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self.protocol.state is State.OPEN and outcome.why in ("caller-closed", "caller-too-big", "error",
                                                                     "credential-ended"):
                # The app hears the caller's close (or ours), as a WebSocket close; nobody waits for its answer.
                code = outcome.code if outcome.why != "error" else GOING_AWAY
                # A close without a code stays one (1005 must never be sent: the payload is empty).
                self.protocol.send_close(*caller_close(code, outcome.reason))
                with contextlib.suppress(Exception):
                    await within(self._flush(), 5)
            with contextlib.suppress(Exception):
                await within(self.conn.close(), 6)
        finally:
            _release(self.sandbox.id)



def _release(sandbox_id: str) -> None:
    left = _OPEN.get(sandbox_id, 0) - 1
    if left > 0:
        _OPEN[sandbox_id] = left
    else:
        _OPEN.pop(sandbox_id, None)


async def open_app_socket(runtime: Any, ts: TenantStore, agent_name: str, user: str, req: AppSocketRequest) -> AppSocket:
    """Open a WebSocket to the app of ``user``'s instance of ``agent_name`` in tenant ``ts``, waking it if asleep.

    The instance is held like a turn for the handshake only. Raises NotFound (no such agent or user, or no app),
    AppUnavailable (502: not listening, too slow), AppSocketRefused (the app's own 4xx, else 502) and
    AppSocketsExhausted (429). The returned socket must be ``relay``ed (which releases it).
    """
    config = runtime.config
    max_message = int(config.app_ws_max_message_bytes)
    agent, lc, scope, deployment, port = await app_of(runtime, ts, agent_name, user)
    target = req.target.decode("latin-1")
    if not target.startswith("/") or any(c <= " " or c == "\x7f" for c in target):
        raise InvalidInput("malformed path for the agent's app")

    async def template() -> Any:
        return await runtime._template_for(ts, agent)

    async with runtime.instances.turn(ts, scope, template, lifecycle=lc) as sandbox:
        if _OPEN.get(sandbox.id, 0) >= int(config.app_ws_max_sockets):
            raise AppSocketsExhausted(f"this app already has {config.app_ws_max_sockets} WebSockets open",
                                      hint="close some, or raise app_ws_max_sockets")
        _OPEN[sandbox.id] = _OPEN.get(sandbox.id, 0) + 1
        conn: GuestConnection | None = None
        try:
            from moorage.runtime.vm_network import attach

            def network(channel: Any) -> None:  # its own network, on each connection
                attach(runtime, sandbox.id, channel, ts, agent_name, user, deployment.manifest)

            network(live_channel(sandbox))
            opened = await open_connection(runtime, sandbox, deployment, port, ts=ts, agent_name=agent_name, user=user,
                                           on_restart=network, idle_s=GUEST_IDLE_S)
            conn = GuestConnection(sandbox.channel, int(opened["conn"]), float(config.app_timeout_s))
            protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/"), subprotocols=req.subprotocols or None,
                                      max_size=max_message)
            request = protocol.connect()
            request.path = target
            headers = Headers()
            for k, v in req.headers:
                name = k.decode("latin-1").lower()
                if name not in _DROP_HANDSHAKE and name not in ("upgrade", "connection"):
                    headers[name] = v.decode("latin-1")
            for k2, v2 in request.headers.raw_items():
                headers[k2] = v2
            headers["X-Forwarded-Prefix"] = req.prefix
            headers["X-Forwarded-Proto"] = "http"
            for origin in origin_for(req.headers, port):
                headers["Origin"] = origin
            request.headers = headers
            protocol.send_request(request)
            until = time.monotonic() + float(config.app_timeout_s)
            response, early = await _handshake(conn, protocol, until)
            if protocol.handshake_exc is not None or response.status_code != 101:
                status = response.status_code
                if isinstance(protocol.handshake_exc, InvalidStatus) and 400 <= status < 500:
                    err = AppSocketRefused(f"the agent's app refused the WebSocket (HTTP {status})",
                                           hint="check the path and what the app accepts")
                    err.http_status = status
                    raise err
                raise AppSocketRefused("the agent's app did not accept the WebSocket",
                                       hint="serve WebSocket upgrades on the app's port")
        except BaseException:
            if conn is not None:
                await conn.close()
            _release(sandbox.id)
            raise
    own = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.raw_items()
           if k.lower() not in _DROP_SWITCH]
    return AppSocket(runtime, ts, scope, sandbox, sandbox.channel, conn, protocol, protocol.subprotocol,
                     max_message, early, headers=own)


async def _handshake(conn: GuestConnection, protocol: ClientProtocol, until: float) -> tuple[Response, list[Any]]:
    try:
        await conn.write(b"".join(protocol.data_to_send()))
    except AppStalled:
        raise too_slow() from None
    except InstanceGone:
        raise AppUnavailable("the sandbox stopped answering", hint="retry; the agent's instance may be restarting") from None
    while True:
        try:
            data = await conn.read(until)
        except InstanceGone:
            raise AppUnavailable("the sandbox stopped answering", hint="retry; the agent's instance may be restarting") from None
        if data is None:
            protocol.receive_eof()
        else:
            protocol.receive_data(data)
        events = protocol.events_received()
        for i, ev in enumerate(events):
            if isinstance(ev, Response):
                return ev, events[i + 1:]
        if data is None or protocol.handshake_exc is not None:
            raise AppUnavailable("the agent's app closed the connection before answering the WebSocket handshake",
                                 hint="serve WebSocket upgrades on the app's port")
