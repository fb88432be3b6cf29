"""One agent as an MCP server for one request: its tools (``send_message``) and resources (the caller's sessions).

Built with the official SDK, whose import is heavy (hundreds of pydantic models): ``api/mcp.py`` imports this module
on the first MCP request, not at start (``moorage.cli.up.LAZY_IMPORTS``).
"""

from __future__ import annotations

import json
from typing import Any

import mcp_types as mt
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.concurrency import run_in_threadpool

from moorage.api.invoke_shared import MAX_MESSAGE_CHARS
from moorage.api.routing import Call
from moorage.errors import InvalidInput, MoorageError, NotFound, TenantScopeError
from moorage.lifecycle.manager import Misplaced
from moorage.store import EntityKey, Principal, Scope, TenantStore
from moorage.store.model import check_id
from moorage.usage.caps import enforce as enforce_caps

__all__ = ["AgentMcp", "StreamableHTTPSessionManager"]

SEND_MESSAGE = "send_message"
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


