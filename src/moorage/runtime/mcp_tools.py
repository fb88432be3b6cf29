"""The host-side MCP client: agents use external MCP servers through ``ctx.mcp`` without ever holding their credentials.

Servers come from the agent's manifest (``[agent.mcp.<name>] url = ...``, no secrets) and from the host's
``<data_dir>/mcp.toml`` (per tenant, with headers resolved from the host environment). See docs/mcp.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moorage.aio import within
from moorage.errors import ConfigError, InvalidInput, NotFound, UnavailableError
from moorage.log import get_logger

if TYPE_CHECKING:
    from moorage.runtime.host_calls import TurnBinding
    from moorage.runtime.runtime import Runtime

log = get_logger(__name__)

HOST_CONFIG_FILE = "mcp.toml"
#: Sessions whose tool lists are kept; the oldest is dropped first (a session refetches on its next call).
SCHEMA_CACHE_SESSIONS = 4096
#: Largest tool result text handed back to a guest.
MAX_RESULT_CHARS = 1 << 20
CALL_TIMEOUT_S = 60.0
#: An open server connection with no call for this long is closed (the next call reconnects).
CONNECTION_IDLE_S = 300.0
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class McpServer:
    """One external MCP server as the host reaches it; ``headers`` never leave the host."""

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)


def _resolve_env(value: str, where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in os.environ:
            raise ConfigError(f"{where} names the environment variable {m.group(1)}, which is not set",
                              hint="export it in the environment of the moorage host process")
        return os.environ[m.group(1)]

    return _ENV_REF.sub(sub, value)


class HostMcpConfig:
    """``<data_dir>/mcp.toml``: ``[tenants.<tenant_id>.servers.<name>]`` with ``url`` and ``headers``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._doc: dict[str, Any] = {}

    def _load(self) -> dict[str, Any]:
        # Re-read when the operator edits the file, so a rotated key takes effect without a restart.
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._mtime, self._doc = None, {}
            return self._doc
        if mtime != self._mtime:
            with self.path.open("rb") as f:
                try:
                    self._doc = tomllib.load(f)
                except tomllib.TOMLDecodeError as e:
                    raise ConfigError(f"{self.path} is not valid TOML: {e}") from e
            self._mtime = mtime
        return self._doc

    def servers(self, tenant_id: str) -> dict[str, McpServer]:
        table = ((self._load().get("tenants") or {}).get(tenant_id) or {}).get("servers") or {}
        out = {}
        for name, spec in table.items():
            where = f"{self.path.name} [tenants.{tenant_id}.servers.{name}]"
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ConfigError(f"{where} needs url = \"http...\"")
            headers = {str(k): _resolve_env(str(v), where) for k, v in (spec.get("headers") or {}).items()}
            out[name] = McpServer(name, spec["url"], headers)
        return out


def servers_for(manifest: dict[str, Any], host: dict[str, McpServer]) -> dict[str, McpServer]:
    """The servers one agent may call: its manifest's (no credentials) and its tenant's host-configured ones.

    A name in both resolves to the host's entry: credentials only ever go to the URL the operator chose.
    """
    out: dict[str, McpServer] = {}
    for name, spec in (manifest.get("mcp") or {}).items():
        if isinstance(spec, dict) and isinstance(spec.get("url"), str) and spec["url"].startswith(("http://", "https://")):
            out[name] = McpServer(name, spec["url"])
    out.update(host)
    return out


def _result_dict(result: Any) -> dict[str, Any]:
    content, texts = [], []
    for item in result.content or []:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        content.append(data)
        if data.get("type") == "text":
            texts.append(data.get("text", ""))
    text = "\n".join(texts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS]
    return {"text": text, "content": content, "structured": result.structured_content,
            "is_error": bool(result.is_error)}


class McpTools:
    """One per runtime: fetches each session's tool schemas once, and makes the calls guests ask for."""

    def __init__(self, runtime: "Runtime") -> None:
        self.rt = runtime
        self.host_config = HostMcpConfig(runtime.config.data_dir / HOST_CONFIG_FILE)
        self._schemas: OrderedDict[tuple[str, ...], list[dict[str, Any]]] = OrderedDict()
        self._fetching: dict[tuple[str, ...], asyncio.Lock] = {}
        self._connections: OrderedDict[tuple[str, ...], _Connection] = OrderedDict()

    def servers(self, b: "TurnBinding") -> dict[str, McpServer]:
        return servers_for(b.manifest, self.host_config.servers(b.ts.tenant_id))

    async def tools(self, b: "TurnBinding") -> list[dict[str, Any]]:
        """Every tool of every server this agent may use, sorted: fetched once per session (a stable prompt prefix).

        A server that cannot be reached is left out of this answer (and asked again next time), so one
        broken server never hides the others.
        """
        out: list[dict[str, Any]] = []
        for server in sorted(self.servers(b).values(), key=lambda s: s.name):
            try:
                out += await self._server_tools(b, server)
            except UnavailableError:
                continue
        return out

    @staticmethod
    def _key(b: "TurnBinding", server: McpServer) -> tuple[str, ...]:
        # The credentials' digest is part of the key: a key rotated in mcp.toml opens a fresh connection.
        creds = hashlib.sha256(json.dumps(server.headers, sort_keys=True).encode()).hexdigest()
        return (b.ts.tenant_id, b.entity.agent, b.entity.user, b.entity.session or "default", b.deployment_id,
                server.name, server.url, creds)

    async def _server_tools(self, b: "TurnBinding", server: McpServer) -> list[dict[str, Any]]:
        key = self._key(b, server)
        cached = self._schemas.get(key)
        if cached is not None:
            self._schemas.move_to_end(key)
            return cached
        lock = self._fetching.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent first calls of one session fetch once
            if key not in self._schemas:
                started = time.perf_counter()
                attrs = {"mcp.server": server.name}
                try:
                    listed = await self._session_do(key, server, lambda c: c.list_tools())
                except UnavailableError:
                    self.rt.tracer.span(b, "mcp.list_tools", started, status="error", **attrs)
                    raise
                finally:
                    self._fetching.pop(key, None)
                self.rt.tracer.span(b, "mcp.list_tools", started, **attrs)
                self._schemas[key] = [{"server": server.name, "name": t.name, "description": t.description or "",
                                       "parameters": dict(t.input_schema or {"type": "object", "properties": {}})}
                                      for t in sorted(listed.tools, key=lambda t: t.name)]
                while len(self._schemas) > SCHEMA_CACHE_SESSIONS:
                    self._schemas.popitem(last=False)
        return self._schemas[key]

    async def call(self, b: "TurnBinding", server_name: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call one tool for this turn; recorded as a span with the trace id and entity key."""
        if not isinstance(server_name, str) or not _NAME.fullmatch(server_name):
            raise InvalidInput("mcp.call needs a server name")
        if not isinstance(arguments, dict):
            raise InvalidInput("mcp.call arguments must be an object")
        server = self.servers(b).get(server_name)
        if server is None:
            raise NotFound(f"no MCP server {server_name!r} for this agent",
                           hint=f"list it as [agent.mcp.{server_name}] url = \"...\" in moorage.toml")
        # Only tools the server listed (and the model was shown) can be called.
        if not any(t["name"] == tool for t in await self._server_tools(b, server)):
            raise NotFound(f"MCP server {server_name!r} has no tool {tool!r}")
        started = time.perf_counter()
        attrs = {"mcp.server": server_name, "mcp.tool": tool}
        try:
            result = await self._session_do(self._key(b, server), server, lambda c: c.call_tool(tool, arguments))
        except UnavailableError:
            self.rt.tracer.span(b, "mcp.tool", started, status="error", **attrs)
            raise
        out = _result_dict(result)
        self.rt.tracer.span(b, "mcp.tool", started, status="error" if out["is_error"] else "ok", **attrs)
        return out

    async def _session_do(self, key: tuple[str, ...], server: McpServer, action: Any) -> Any:
        conn = self._connections.get(key)
        if conn is None or conn.closed:
            conn = self._connections[key] = _Connection(server)
            while len(self._connections) > SCHEMA_CACHE_SESSIONS:
                self._connections.popitem(last=False)[1].close()
        self._connections.move_to_end(key)
        try:
            return await conn.do(action)
        except UnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - any protocol failure: name the server, never its headers
            e = _leaf(e)
            log.warning("mcp server call failed", server=server.name, error=type(e).__name__)
            raise UnavailableError(f"MCP server {server.name!r} failed: {type(e).__name__}: {_safe(e, server)}",
                                   hint="check that the server is up and its credentials in mcp.toml") from None

    async def close(self) -> None:
        """Close every open server connection (the runtime's shutdown; idle ones also close on their own)."""
        conns = list(self._connections.values())
        self._connections.clear()
        for c in conns:
            c.close()
        await asyncio.gather(*(c.task for c in conns), return_exceptions=True)


def _leaf(e: BaseException) -> BaseException:
    """The first real failure inside the task groups' exception groups the MCP client raises (anyio wraps them)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _safe(e: BaseException, server: McpServer) -> str:
    text = str(e)[:300]
    for value in server.headers.values():
        if value:
            text = text.replace(value, "***")
    return text


class _Connection:
    """One open MCP client session to one server for one agent session, owned by its own task.

    The SDK client lives inside an anyio task group that must stay in one task, so calls from turns are
    queued to that task. Keeping it open means one handshake and one tool listing per session, not per call.
    """

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.closed = False
        self._jobs: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def do(self, action: Any) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._jobs.put_nowait((action, fut))
        return await within(fut, CALL_TIMEOUT_S)

    def close(self) -> None:
        self.closed = True
        self.task.cancel()

    async def _run(self) -> None:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        failure: BaseException | None = None
        try:
            async with httpx2.AsyncClient(headers=self.server.headers, timeout=CALL_TIMEOUT_S) as http, \
                    Client(streamable_http_client(self.server.url, http_client=http)) as client:
                while True:
                    try:
                        action, fut = await within(self._jobs.get(), CONNECTION_IDLE_S)
                    except TimeoutError:
                        return
                    if fut.done():  # its caller gave up waiting
                        continue
                    try:
                        fut.set_result(await action(client))
                    except Exception as e:  # noqa: BLE001 - handed to the caller, the connection stays usable
                        if not fut.done():
                            fut.set_exception(e)
        except Exception as e:  # noqa: BLE001 - connect or transport failure: every waiting call gets it
            failure = _leaf(e)
            log.warning("mcp connection closed", server=self.server.name, error=type(failure).__name__)
        finally:
            self.closed = True
            while not self._jobs.empty():
                _, fut = self._jobs.get_nowait()
                if not fut.done():
                    fut.set_exception(UnavailableError(
                        f"MCP server {self.server.name!r} is unreachable"
                        + (f": {type(failure).__name__}: {_safe(failure, self.server)}" if failure else ""),
                        hint="check that the server is up and its credentials in mcp.toml"))
