"""Every deployed agent as an MCP server over Streamable HTTP: ``POST /mcp/{agent}`` (or ``/mcp`` with an end-user token).

Each request is authenticated by the API's own ``Endpoint`` wrapper, then served by a per-request,
per-principal MCP server built with the official SDK (stateless, JSON responses): nothing is shared
between tenants, so no MCP session can outlive or cross the credential that opened it.
"""

from __future__ import annotations

import json
from typing import Any

import mcp_types as mt
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from moorage.api import schemas as S
from moorage.api.invoke_shared import MAX_MESSAGE_CHARS
from moorage.api.jsonbody import JsonTooDeep, loads_bounded
from moorage.api.problem import PayloadTooLarge
from moorage.api.routing import Call, Endpoint
from moorage.errors import InvalidInput, MoorageError, NotFound, TenantScopeError
from moorage.lifecycle.manager import Misplaced
from moorage.store import EntityKey, Principal, Scope, TenantStore
from moorage.store.model import check_id
from moorage.usage.caps import enforce as enforce_caps

SEND_MESSAGE = "send_message"
#: Largest JSON-RPC message an MCP route accepts: a send_message of MAX_MESSAGE_CHARS fits even fully escaped.
MCP_BODY_LIMIT = 2 << 20
#: Events of one session shown when a client reads it as a resource (the newest ones).
SESSION_EVENTS_SHOWN = 200
_SEND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "minLength": 1, "description": "what the user says to the agent"},
        "session": {"type": "string", "description": "conversation id (default: 'default')"},
        "user": {"type": "string", "description": "the end-user (tenant keys only; an end-user token pins its own)"},
    },
    "required": ["message"],
}


class AgentMcp:
    """One request's view of one agent: the caller's principal, tenant store and end-user (if known)."""

    def __init__(self, call: Call, agent: str, header_user: str | None) -> None:
        self.call = call
        self.agent = agent
        self.principal: Principal = call.who
        self.ts: TenantStore = call.tenant
        self.header_user = header_user
        #: The instance a tool call addressed is awake on another host: the request goes there (``_serve``).
        self.misplaced: MoorageError | None = None

    def user_for(self, given: Any) -> str:
        """The end-user a call acts for: an end-user token's own, else the argument or X-Moorage-User header."""
        p = self.principal
        if p.user is not None:
            if given not in (None, "", p.user):
                raise TenantScopeError("this end-user token is for another user", hint="omit `user`")
            return p.user
        user = given or self.header_user
        if not isinstance(user, str) or not user:
            raise InvalidInput("missing user", hint="pass `user` as a tool argument or the X-Moorage-User header")
        return check_id(user, "user id")

    # -- tools ---------------------------------------------------------------------------------

    async def list_tools(self, _ctx: ServerRequestContext[Any, Any], _params: Any) -> mt.ListToolsResult:
        agent = await run_in_threadpool(self.ts.agents.get, self.agent)
        desc = (agent.config or {}).get("description") or f"Send a message to the agent {self.agent!r} and get its reply."
        return mt.ListToolsResult(tools=[mt.Tool(name=SEND_MESSAGE, description=str(desc), input_schema=_SEND_SCHEMA)])

    async def call_tool(self, _ctx: ServerRequestContext[Any, Any], params: mt.CallToolRequestParams) -> mt.CallToolResult:
        if params.name != SEND_MESSAGE:
            return _tool_error(f"unknown tool {params.name!r}; this server has {SEND_MESSAGE!r}")
        args = dict(params.arguments or {})
        try:
            message, session = args.get("message"), args.get("session")
            if not isinstance(message, str) or not message.strip():
                raise InvalidInput("`message` must be a non-empty string")
            if len(message) > MAX_MESSAGE_CHARS:
                raise InvalidInput(f"message longer than {MAX_MESSAGE_CHARS} characters")
            if session is not None:
                session = check_id(session, "session id")
            entity = EntityKey(self.agent, self.user_for(args.get("user")), session)
            # The same caps as an HTTP turn (compute, tokens, cost per user); the tenant's awake limit is the
            # instance manager's, on every path.
            await enforce_caps(self.call.ctx.runtime, self.ts, entity)
            result = await self.call.runtime.invoke(self.principal, entity, message)
            from moorage.api.routes.executions import announce_interrupt

            await run_in_threadpool(announce_interrupt, self.call, result)  # waiting for a human: a webhook event
        except Misplaced as e:
            self.misplaced = e
            return _tool_error(e)
        except MoorageError as e:
            # Reported inside the tool result, as MCP asks, so the model calling us can react to it.
            return _tool_error(e)
        meta = {"status": result.status, "turn_id": result.turn_id, "trace_id": result.trace_id,
                "run_id": result.run_id, "interrupt": result.interrupt}
        if result.status == "waiting":
            text = "The agent is waiting for a human answer: " + json.dumps(result.interrupt, default=str)
        else:
            reply = result.reply
            text = reply if isinstance(reply, str) else json.dumps(reply, default=str)
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=text)], structured_content=meta)

    # -- resources: the caller's sessions, each readable as its recent log -----------------------

    def _uri(self, user: str, session: str) -> str:
        return f"moorage://agents/{self.agent}/users/{user}/sessions/{session}"

    async def list_resources(self, _ctx: ServerRequestContext[Any, Any], _params: Any) -> mt.ListResourcesResult:
        try:
            user = self.user_for(None)
        except InvalidInput:
            return mt.ListResourcesResult(resources=[])  # a tenant key without a user: nothing is one user's
        sessions = await run_in_threadpool(self.ts.sessions.list, self.agent, user, limit=1000)
        return mt.ListResourcesResult(resources=[
            mt.Resource(uri=self._uri(user, s.id), name=f"session {s.id}", mime_type="text/plain",
                        description=f"the conversation log of session {s.id!r}")
            for s in sessions])

    async def read_resource(self, _ctx: ServerRequestContext[Any, Any],
                            params: mt.ReadResourceRequestParams) -> mt.ReadResourceResult:
        uri = str(params.uri)
        user = self.user_for(None)
        prefix = self._uri(user, "")
        # Only the caller's own sessions resolve; any other URI is unknown rather than forbidden (nothing leaks).
        if not uri.startswith(prefix):
            raise NotFound(f"no resource {uri!r}")
        session = check_id(uri[len(prefix):], "session id")
        events = await run_in_threadpool(self.ts.events.list, Scope.session(self.agent, user, session), limit=100_000)
        events = sorted(events, key=lambda e: e.id)[-SESSION_EVENTS_SHOWN:]
        text = "\n".join(f"{e.speaker or e.kind}: {e.content}" for e in events)
        return mt.ReadResourceResult(contents=[mt.TextResourceContents(uri=uri, mime_type="text/plain", text=text)])

    def server(self) -> Server[Any]:
        return Server(f"moorage-{self.agent}", version="1", instructions=f"The moorage agent {self.agent!r}.",
                      # Modern-era calls validate arguments against this, not by re-running list_tools.
                      get_tool_input_schema=lambda name: _SEND_SCHEMA if name == SEND_MESSAGE else None,
                      on_list_tools=self.list_tools, on_call_tool=self.call_tool,
                      on_list_resources=self.list_resources, on_read_resource=self.read_resource)


def _tool_error(error: str | MoorageError) -> mt.CallToolResult:
    """A failed call as a tool result; a typed error also carries its code, hint and retry time."""
    if isinstance(error, str):
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=error)], is_error=True)
    text = error.message + (f" ({error.hint})" if error.hint else "")
    meta: dict[str, Any] = {"error": error.code, "detail": error.message, "hint": error.hint}
    retry = getattr(error, "retry_after", None) or getattr(error, "retry_after_s", None)
    if isinstance(retry, (int, float)):
        meta["retry_after_s"] = float(retry)
    if isinstance(getattr(error, "cap", None), str):
        meta["cap"] = error.cap  # type: ignore[attr-defined]
    return mt.CallToolResult(content=[mt.TextContent(type="text", text=text)], structured_content=meta, is_error=True)


async def _serve(call: Call, agent: str) -> Response:
    """Run the SDK's Streamable HTTP transport for this one request and hand its (JSON) answer back."""
    # The agent must exist in the caller's tenant before any MCP traffic: another tenant's name is a plain 404.
    await run_in_threadpool(call.tenant.agents.get, check_id(agent, "agent name"))
    mcp = AgentMcp(call, agent, call.request.headers.get("x-moorage-user"))
    # A fresh stateless manager per request: its task group lives exactly as long as this request, so the
    # app needs no lifespan hook and no MCP state survives between requests (or tenants).
    manager = StreamableHTTPSessionManager(mcp.server(), json_response=True, stateless=True, session_idle_timeout=None)
    start: dict[str, Any] = {}
    body: list[bytes] = []

    async def capture(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    receive = await _bounded_body(call)
    async with manager.run():
        await manager.handle_request(call.request.scope, receive, capture)
    if mcp.misplaced is not None and _single_message(call):
        # Nothing ran here (the turn refused before starting): the host that holds the instance answers the
        # whole request (docs/fleet.md). A batch is answered here, with that call's error, so nothing runs twice.
        raise mcp.misplaced
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])
               if k.lower() not in (b"content-length", b"x-trace-id")}
    return Response(b"".join(body), status_code=int(start.get("status", 500)), headers=headers)


async def _bounded_body(call: Call) -> Any:
    """Read the JSON-RPC body here, counting bytes as they arrive, and hand the SDK a replay of it.

    The SDK would buffer a body of any size before its own check; reading it here first bounds it to
    ``MCP_BODY_LIMIT`` (413) and refuses deep nesting (400) before the SDK parses anything.
    """
    declared = call.request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MCP_BODY_LIMIT:
        raise PayloadTooLarge(f"MCP message is {declared} bytes; the limit is {MCP_BODY_LIMIT}", hint="send a smaller message")
    chunks: list[bytes] = []
    size = 0
    async for chunk in call.request.stream():
        size += len(chunk)
        if size > MCP_BODY_LIMIT:
            raise PayloadTooLarge(f"MCP message exceeds {MCP_BODY_LIMIT} bytes", hint="send a smaller message")
        chunks.append(chunk)
    raw = b"".join(chunks)
    call.request.scope["state"]["raw_body"] = raw  # what a fleet forward sends on (the stream is consumed)
    try:
        loads_bounded(raw)
    except JsonTooDeep:
        raise
    except InvalidInput:
        pass  # not JSON at all: the SDK answers that with its own JSON-RPC parse error
    replayed = False

    async def receive() -> dict[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await call.request.receive()  # after the body: only a disconnect can arrive

    return receive


def _single_message(call: Call) -> bool:
    raw = call.request.scope["state"].get("raw_body", b"")
    return raw.lstrip().startswith(b"{")


async def mcp_for_agent(call: Call) -> Response:
    return await _serve(call, call.path["agent"])


async def mcp_for_token(call: Call) -> Response:
    if call.who.agent is None:
        raise InvalidInput("this credential names no agent", hint="use /mcp/{agent} with a tenant key, or an end-user token")
    return await _serve(call, call.who.agent)


#: In ``all_endpoints()`` like every route (the cross-tenant suite and OpenAPI see them). No ``body`` is
#: declared: the JSON-RPC message is read by ``_bounded_body`` (same limit as ``max_body``) for the SDK; it is
#: documented (``body_doc``) for generated clients.
ENDPOINTS = [
    Endpoint("POST", "/mcp/{agent}", mcp_for_agent,
             "MCP server of one agent (Streamable HTTP; the body is a JSON-RPC message, see docs/mcp.md)", "mcp",
             "mcpAgent", scope="invoke", end_user=True, idempotency="none", max_body=MCP_BODY_LIMIT, long_lived=True,
             body_doc=S.ref("McpRequest"), response=S.ref("McpResponse"),
             other_responses=((202, None),)),  # 202: a notification, no body
    Endpoint("POST", "/mcp", mcp_for_token,
             "MCP server of the end-user token's agent (Streamable HTTP; see docs/mcp.md)", "mcp",
             "mcpToken", scope="invoke", end_user=True, idempotency="none", max_body=MCP_BODY_LIMIT, long_lived=True,
             body_doc=S.ref("McpRequest"), response=S.ref("McpResponse"), other_responses=((202, None),)),
]
