"""Every deployed agent as an MCP server over Streamable HTTP: ``POST /mcp/{agent}`` (or ``/mcp`` with an end-user token).

Each request is authenticated by the API's own ``Endpoint`` wrapper, then served by a per-request,
per-principal MCP server built with the official SDK (stateless, JSON responses): nothing is shared
between tenants, so no MCP session can outlive or cross the credential that opened it. The server itself
(``api/mcp_server.py``) and the SDK are imported by the first MCP request, not when the app is built: that import
took a third of a host's start (``moorage.cli.up.LAZY_IMPORTS``).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from moorage.api import schemas as S
from moorage.api.jsonbody import JsonTooDeep, loads_bounded
from moorage.api.problem import PayloadTooLarge
from moorage.api.routing import Call, Endpoint
from moorage.errors import InvalidInput
from moorage.store.model import check_id

#: Largest JSON-RPC message an MCP route accepts: a send_message of MAX_MESSAGE_CHARS fits even fully escaped.
MCP_BODY_LIMIT = 2 << 20

def _mcp_server() -> Any:
    """``api/mcp_server.py``, imported by the first MCP request in a worker thread: the SDK's import takes about half
    a second, and the event loop serves the host's other requests meanwhile."""
    import moorage.api.mcp_server

    return moorage.api.mcp_server


async def _serve(call: Call, agent: str) -> Response:
    """Run the SDK's Streamable HTTP transport for this one request and hand its (JSON) answer back."""
    # The agent must exist in the caller's tenant before any MCP traffic: another tenant's name is a plain 404.
    await run_in_threadpool(call.tenant.agents.get, check_id(agent, "agent name"))
    server = await run_in_threadpool(_mcp_server)
    mcp = server.AgentMcp(call, agent, call.request.headers.get("x-moorage-user"))
    # A fresh stateless manager per request: its task group lives exactly as long as this request, so the
    # app needs no lifespan hook and no MCP state survives between requests (or tenants).
    manager = server.StreamableHTTPSessionManager(mcp.server(), json_response=True, stateless=True, session_idle_timeout=None)
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
