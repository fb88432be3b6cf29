"""An agent's own web app over HTTP: the owner's route, share links that open it without a key, and their admin.

``/v1/agents/{agent}/users/{user}/app/...`` needs a key with the ``invoke`` scope (or that user's end-user
token); ``/v1/shared/{token}/...`` needs only a live share link, and reaches that one user's app and nothing else.
WebSockets to the same paths are authorized exactly like the ``GET`` route of that path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

from starlette.requests import HTTPConnection
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from moorage.api import schemas as S
from moorage.api.credential_watch import Watch, Watched, until_ended
from moorage.api.routes._common import agent_of, known_user
from moorage.api.routing import Call, Endpoint, Reply
from moorage.api.problem import from_error, internal
from moorage.errors import InvalidInput, MoorageError, NotFound, UnavailableError
from moorage.fleet.forward import ForwardedSocket, ForwardRefused, forwarded, forwarded_by, forwarded_trace_id
from moorage.log import get_logger
from moorage.observability import new_trace_id, use_trace_id
from moorage.store.model import check_id
from moorage.ws_close import NO_STATUS, sendable_reason

#: Request bodies the app routes accept (the runtime's own cap, app_max_request_bytes, applies too).
APP_BODY_LIMIT = 16 << 20
APP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_APP = "/v1/agents/{agent}/users/{user}/app"
_SHARED = "/v1/shared/{token}"
_LINKS = "/v1/agents/{agent}/users/{user}/share-links"


log = get_logger(__name__)


def _target(conn: HTTPConnection, prefix: str) -> bytes:
    """The path and query the app sees: the raw request path after ``prefix`` (percent-encoding kept)."""
    raw = conn.scope.get("raw_path") or conn.url.path.encode()
    rest = raw[len(prefix):] if raw.startswith(prefix.encode()) else quote(conn.path_params.get("path", "")).encode()
    if not rest.startswith(b"/"):
        rest = b"/" + rest
    qs = conn.scope.get("query_string") or b""
    return rest + (b"?" + qs if qs else b"")


async def _relay(call: Call, ts: Any, agent: str, user: str, prefix: str) -> Response:
    from moorage.runtime.app_proxy import AppRequest, app_request

    async def body() -> Any:
        async for chunk in call.request.stream():
            yield chunk

    req = AppRequest(call.request.method, _target(call.request, prefix), list(call.request.headers.raw), body(), prefix)
    resp = await app_request(call.runtime, ts, agent, user, req)
    out = StreamingResponse(resp.body, status_code=resp.status)
    out.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers]
    return out


def _query(call: Call) -> str:
    """The request's query, kept by a redirect to the app's root (``?tab=2`` on a shared link still opens that tab)."""
    qs = call.request.scope.get("query_string") or b""
    return "?" + qs.decode("latin-1") if qs else ""


def _ids(call: Call | HTTPConnection) -> tuple[str, str]:
    path = call.path if isinstance(call, Call) else call.path_params
    return check_id(path["agent"], "agent name"), check_id(path["user"], "user id")


async def serve_app(call: Call) -> Response:
    agent, user = _ids(call)
    return await _relay(call, call.tenant, agent, user, f"/v1/agents/{agent}/users/{user}/app")


async def app_root(call: Call) -> Response:
    agent, user = _ids(call)
    await asyncio.to_thread(agent_of, call)  # another tenant's agent is a 404 here too
    return RedirectResponse(f"/v1/agents/{agent}/users/{user}/app/{_query(call)}", status_code=308)


async def _open_link(call: Call) -> tuple[Any, Any]:
    return await _open_token(call.runtime, call.ctx.store, call.path["token"])


async def _open_token(runtime: Any, store: Any, token: str) -> tuple[Any, Any]:
    from moorage.runtime.share_links import signer_of

    return await asyncio.to_thread(signer_of(runtime).open, store, token)


async def serve_shared(call: Call) -> Response:
    """A share link's request is recorded in its tenant's traces as the owner's route records its own (the routing
    layer cannot: the route has no credentials, so no tenant until the link is opened); the span names the route's
    template, never the link's token."""
    from moorage.lifecycle.manager import Misplaced

    started = time.time()
    ts, link = await _open_link(call)
    status: int | None = 500
    watch = _link_watch(call)
    try:
        response = await watch.race(_relay(call, ts, link.agent, link.user, f"/v1/shared/{call.path['token']}"))
        status = response.status_code
        # Ends with the link, as the owner's route ends with its key: a server-sent stream with a final error
        # event, any other body still streaming cut, an answer not begun a 401.
        return Watched(response, watch, call.trace_id, openai=False)
    except Misplaced:
        watch.stop()
        status = None  # another host of the fleet serves it, and records it there
        raise
    except MoorageError as e:
        watch.stop()
        status = e.http_status
        raise
    except BaseException:
        watch.stop()
        raise
    finally:
        if status is not None:
            await asyncio.to_thread(_record_shared, call, ts, link, status, started)


def _link_watch(call: Call) -> Watch:
    """The share link checked again while its request lasts (``api/credential_watch.py``): a link revoked or expired
    meanwhile ends the app's answer. Nothing else is ended with it: an app's request starts no turn."""
    token = call.path["token"]

    async def nothing(e: Any) -> None:
        log.info("an app request ended with its share link", trace_id=call.trace_id, why=e.cause.message)

    return Watch(lambda: _open_token(call.runtime, call.ctx.store, token), nothing, starts_turns=False)


def _record_shared(call: Call, ts: Any, link: Any, status: int, started: float) -> None:
    route = call.request.scope["state"].get("route") or _SHARED + "/{path:path}"
    with use_trace_id(call.trace_id):
        active = call.ctx.tracer.start(ts, f"{call.request.method} {route}", **{
            "http.method": call.request.method, "http.route": route, "http.status_code": status,
            "moorage.agent": link.agent, "moorage.user": link.user})
        active.span_id = call.request.scope["state"].get("span_id") or active.span_id
        active.start_ts = started
        active.parent_id = None
        if status >= 500:
            active.status = "error"
        call.ctx.tracer.finish(ts, active)


async def shared_root(call: Call) -> Response:
    await _open_link(call)
    return RedirectResponse(f"/v1/shared/{call.path['token']}/{_query(call)}", status_code=308)


def _render(link: Any) -> dict[str, Any]:
    return {"id": link.id, "agent": link.agent, "user": link.user, "label": link.label,
            "created_at": link.created_at, "expires_at": link.expires_at, "revoked_at": link.revoked_at}


def create_link(call: Call) -> Reply:
    from moorage.runtime.share_links import signer_of
    from moorage.runtime.sizing import app_ports

    agent, user = _ids(call)
    rec = agent_of(call)
    # A link to nobody is a 404, not a dangling link. The link is for the users its app serves (``app_of``, as a
    # turn: ``Router.resolve``): registered, or with a session of the agent (registered as the link is first opened).
    # Not ``known_user``: the app refuses a user with only an instance left. Nor any id under lifecycle.users =
    # "auto": a mistyped one would get a link to a user nobody has.
    if call.tenant.agent_users.find(agent, user) is None and not call.tenant.sessions.list(agent, user, limit=1):
        raise NotFound(f"agent {agent!r} has no user {user!r}",
                       hint=f"create the end-user first (PUT /v1/agents/{agent}/users/{user}) or let them talk to it")
    live = call.tenant.deployments.get(rec.live_deployment) if rec.live_deployment else None
    if live is None or not app_ports(live.manifest):  # a link to no app would only ever answer 404
        raise NotFound(f"agent {agent!r} serves no app", hint='declare its port in moorage.toml: ports = [8080]')
    ttl = call.field("ttl_s", (int, float), required=False, default=3600)
    label = call.field("label", str, required=False, default="")
    if isinstance(ttl, bool):
        raise InvalidInput("ttl_s must be a number of seconds")
    link = call.tenant.share_links.create(agent, user, ttl, label)
    token = signer_of(call.runtime).token(call.tenant.tenant_id, link)
    return Reply({**_render(link), "token": token, "url": f"/v1/shared/{token}/"}, 201)


def list_links(call: Call) -> dict[str, Any]:
    agent, user = _ids(call)
    agent_of(call)
    links = call.tenant.share_links.list(agent, user)
    if not links:  # none: for a user the agent has, not for a mistyped id
        known_user(call, agent, user)
    return {"data": [_render(link) for link in links]}


def revoke_link(call: Call) -> dict[str, Any]:
    agent, user = _ids(call)
    agent_of(call)
    return _render(call.tenant.share_links.revoke(agent, user, call.path["link_id"]))


LINK = S.obj({"id": S.STR, "agent": S.STR, "user": S.STR, "label": S.STR, "created_at": S.NUM,
              "expires_at": S.NUM, "revoked_at": S.NNUM})
NEW_LINK = S.obj({**LINK["properties"], "token": S.NSTR, "url": S.NSTR})
_LINK_BODY = S.obj({"ttl_s": {"type": "number", "minimum": 1, "description": "seconds the link works (default 3600)"},
                    "label": {"type": "string", "maxLength": 200}}, [])

ENDPOINTS = [
    *(Endpoint(m, _APP + "/{path:path}", serve_app, "The user's instance of the agent serves this request on its app port",
               "apps", f"app{m.capitalize()}", scope="invoke", end_user=True, idempotency="none",
               max_body=APP_BODY_LIMIT, relayed=True, long_lived=True) for m in APP_METHODS),
    Endpoint("GET", _APP, app_root, "Redirect to the app's root (a trailing slash keeps relative links inside it)",
             "apps", "appRoot", scope="invoke", end_user=True, idempotency="none", status=308),
    *(Endpoint(m, _SHARED + "/{path:path}", serve_shared, "A share link serves this request from one user's app",
               "apps", f"shared{m.capitalize()}", auth="none", idempotency="none", max_body=APP_BODY_LIMIT,
               relayed=True) for m in APP_METHODS),
    Endpoint("GET", _SHARED, shared_root, "Redirect to a shared app's root", "apps", "sharedRoot", auth="none",
             idempotency="none", status=308),
    Endpoint("POST", _LINKS, create_link, "Create a share link to one user's app (its token is shown once)", "apps",
             "createShareLink", scope="invoke", body=_LINK_BODY, response=NEW_LINK, status=201,
             secret_fields=("token", "url")),
    Endpoint("GET", _LINKS, list_links, "List one user's share links (never their tokens)", "apps", "listShareLinks",
             scope="invoke", response=S.obj({"data": {"type": "array", "items": LINK}})),
    Endpoint("DELETE", _LINKS + "/{link_id}", revoke_link, "Revoke a share link", "apps", "revokeShareLink",
             scope="invoke", response=LINK),
]


# -- WebSockets -------------------------------------------------------------------------------------------------------

#: The HTTP routes whose declaration (auth, scope, end-user tokens) a WebSocket to the same path follows.
_OWNER_GET = next(ep for ep in ENDPOINTS if ep.operation_id == "appGet")


class _Caller:
    """The caller's accepted WebSocket as ``runtime.app_socket`` expects it."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def receive(self) -> Any:
        from moorage.runtime.app_socket import CallerClose

        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            # No code is ASGI's 1005 ("no status"): the app is sent a close without one too.
            return CallerClose(int(message.get("code") or NO_STATUS), str(message.get("reason") or ""))
        text = message.get("text")
        return text if text is not None else (message.get("bytes") or b"")

    async def send(self, message: str | bytes) -> None:
        if isinstance(message, str):
            await self.ws.send_text(message)
        else:
            await self.ws.send_bytes(message)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, sendable_reason(reason))


async def _socket(ws: WebSocket, shared: bool) -> None:
    """Authorize like the HTTP route, open the app's socket (its handshake decides ours), then relay; an
    instance awake on another host of the fleet gets the socket relayed from there (fleet/forward.py)."""
    from moorage.lifecycle.manager import Misplaced
    from moorage.runtime.app_socket import AppSocketRequest, open_app_socket

    ctx = ws.app.state.moorage
    trace_id = forwarded_trace_id(ws.scope) or new_trace_id()
    ts = None
    if forwarded_by(ws.scope):  # signed by another host of the fleet; a caller's own marker is ignored
        forwarded.set(True)  # another host sent it here to be served here (never sent on again)
    with use_trace_id(trace_id):
        try:
            if not shared:
                # The same checks as the HTTP route, first: a key with its scope, or that user's end-user token.
                _, ts = await _OWNER_GET._authorize(ctx, ws)
            if ctx.runtime is None:
                raise UnavailableError("this server runs without an agent runtime",
                                       hint="start it with `moorage up` (store-only servers serve data routes only)")
            if shared:
                token = ws.path_params["token"]
                ts, link = await _open_token(ctx.runtime, ctx.store, token)
                agent, user, prefix = link.agent, link.user, f"/v1/shared/{token}"
            else:
                agent, user = _ids(ws)
                prefix = f"/v1/agents/{agent}/users/{user}/app"
            req = AppSocketRequest(_target(ws, prefix), list(ws.headers.raw), list(ws.scope.get("subprotocols") or []),
                                   prefix)
            try:
                sock = await open_app_socket(ctx.runtime, ts, agent, user, req)
            except Misplaced as e:
                sock = await _open_on_owner(ctx, ws, e, trace_id)
        except ForwardRefused as e:
            await _deny(ws, e.response)  # the owner's own answer (its refusal, as it would give it to the caller)
            return
        except MoorageError as e:
            ctx.metrics.observe_error(e.code)
            await _deny(ws, from_error(e, trace_id))
            return
        except Exception:  # noqa: BLE001 - never a traceback to the caller
            log.exception("app socket failed to open", trace_id=trace_id)
            await _deny(ws, internal(trace_id))
            return
        started = time.time()
        try:
            served_by = [(b"x-moorage-served-by", sock.owner_id.encode())] if isinstance(sock, ForwardedSocket) else []
            # The app's own 101 headers (the owner's, through another host), as an HTTP answer's reach the caller.
            await ws.accept(subprotocol=sock.subprotocol, headers=[*sock.headers, *served_by])
        except BaseException:
            await sock.close_unused()
            raise
        if isinstance(sock, ForwardedSocket):
            outcome = await sock.relay(ws)
        else:
            outcome = await sock.relay(_Caller(ws), _credential_ended(ctx, ws, shared))
        await asyncio.to_thread(_record_span, ctx, ts, agent, user, shared, started, outcome, sock)


async def _credential_ended(ctx: Any, ws: WebSocket, shared: bool) -> Any:
    """Returns (an ``Outcome``: close 1008) once the credential that opened ``ws`` no longer would: an end-user
    token expired or its issuing key revoked, a key revoked, a share link revoked or expired; checked as every
    long-lived request's is (``api/credential_watch.py``). Before, a socket opened with it stayed open for good."""
    from moorage.runtime.app_socket import Outcome
    from moorage.ws_close import POLICY_VIOLATION

    header = ws.headers.get("authorization")

    async def check() -> None:
        if shared:
            await _open_token(ctx.runtime, ctx.store, ws.path_params["token"])
        else:
            await ctx.credential_checks.check(header)

    await until_ended(check)
    what = "share link" if shared else "credential"
    return Outcome(POLICY_VIOLATION, f"the {what} that opened this socket was revoked or expired", "credential-ended")


async def _open_on_owner(ctx: Any, ws: WebSocket, e: Any, trace_id: str) -> Any:
    """The instance is awake on another host: a socket to that host, made with the caller's own credentials."""
    fleet = getattr(getattr(ctx.runtime, "instances", None), "fleet", None)
    if fleet is None or e.host is None:
        raise e
    owner = await asyncio.to_thread(fleet.host, e.host)
    if owner is None:
        raise e
    config = ctx.runtime.config
    return await fleet.forwarder.open_socket(ws, owner.id, owner.url, max_message=int(config.app_ws_max_message_bytes),
                                             open_timeout_s=float(config.app_timeout_s) + 10, trace_id=trace_id)


async def _deny(ws: WebSocket, response: Response) -> None:
    try:
        await ws.send_denial_response(response)
    except RuntimeError:  # a server without the denial extension: a close before accepting (HTTP 403)
        await ws.close(1008)


def _record_span(ctx: Any, ts: Any, agent: str, user: str, shared: bool, started: float, outcome: Any,
                 sock: Any) -> None:
    route = _SHARED if shared else _APP
    active = ctx.tracer.start(ts, f"WEBSOCKET {route}/{{path}}", **{
        "http.route": route + "/{path}", "http.status_code": 101, "moorage.agent": agent, "moorage.user": user,
        "websocket.close_code": outcome.code, "websocket.closed_by": outcome.why,
        "websocket.messages_in": sock.messages_in, "websocket.messages_out": sock.messages_out})
    active.start_ts = started
    ctx.tracer.finish(ts, active)


async def socket_app(ws: WebSocket) -> None:
    await _socket(ws, shared=False)


async def socket_shared(ws: WebSocket) -> None:
    await _socket(ws, shared=True)


#: WebSocket routes (OpenAPI has no words for them; docs/app.md describes them). ``api/app.py`` mounts them.
WEBSOCKET_ROUTES = [
    WebSocketRoute(_APP + "/{path:path}", socket_app, name="appSocket"),
    WebSocketRoute(_APP, socket_app, name="appSocketRoot"),
    WebSocketRoute(_SHARED + "/{path:path}", socket_shared, name="sharedSocket"),
    WebSocketRoute(_SHARED, socket_shared, name="sharedSocketRoot"),
]
