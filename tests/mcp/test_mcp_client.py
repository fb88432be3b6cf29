"""Agents calling an external MCP server through the host: a real SDK-built server on 127.0.0.1 that demands a
secret header, an agent deployed through the runtime that calls it with ``ctx.mcp``; the reply comes back, the
secret never reaches the sandbox, the tool schemas are fetched once per session and every call is a span.
"""

from __future__ import annotations

import io
import json
import secrets
import socket
import tarfile
import textwrap
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Iterator

import mcp_types as mt
import pytest
import uvicorn
from mcp.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.applications import Starlette
from starlette.responses import JSONResponse

from moorage.store import EntityKey, Store
from moorage.runtime.mcp_tools import HostMcpConfig, McpServer, servers_for
from tests.api.conftest import free_port

AGENT = '''
import json, os

async def on_message(ctx, message):
    if message == "tools":
        return json.dumps(await ctx.mcp_tools())
    if message == "env":
        return json.dumps(dict(os.environ))
    if message == "down":
        try:
            await ctx.mcp("down", "forecast", city="Oslo")
            return "called"
        except ctx.HostError as e:
            return json.dumps({"kind": e.kind, "error": str(e)})
    if message == "nokey":
        try:
            await ctx.mcp("nokey", "forecast", city="Oslo")
            return "called"
        except Exception as e:
            return "refused: " + str(e)
    result = await ctx.mcp("weather", "forecast", city=message)
    return result["text"]
'''


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class WeatherServer:
    """A real MCP server (official SDK, Streamable HTTP) whose every request needs ``X-Weather-Key``."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.list_calls = 0
        self.refused = 0
        self.keys_seen: list[str] = []

    async def list_tools(self, _ctx: Any, _params: Any) -> mt.ListToolsResult:
        self.list_calls += 1
        return mt.ListToolsResult(tools=[mt.Tool(name="forecast", description="Tomorrow's weather", input_schema=SCHEMA)])

    async def call_tool(self, _ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        city = (params.arguments or {})["city"]
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=f"sunny in {city}")])

    def app(self) -> Any:
        manager = StreamableHTTPSessionManager(
            # The schema hook keeps the server from listing its own tools per call, so list_calls counts clients.
            Server("weather", on_list_tools=self.list_tools, on_call_tool=self.call_tool,
                   get_tool_input_schema=lambda name: SCHEMA if name == "forecast" else None),
            json_response=True, stateless=True)

        @asynccontextmanager
        async def lifespan(_app: Any):
            async with manager.run():
                yield

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            headers = dict(scope.get("headers") or [])
            key = headers.get(b"x-weather-key", b"").decode()
            self.keys_seen.append(key)
            if key != self.secret:
                self.refused += 1
                await JSONResponse({"error": "missing or wrong X-Weather-Key"}, status_code=401)(scope, receive, send)
                return
            await manager.handle_request(scope, receive, send)

        app = Starlette(lifespan=lifespan)
        app.mount("/mcp", guarded)
        return app


@pytest.fixture
def weather() -> Iterator[tuple[WeatherServer, str]]:
    ws = WeatherServer(secrets.token_hex(16))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(ws.app(), host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "weather server did not start"
        time.sleep(0.01)
    yield ws, f"http://127.0.0.1:{port}/mcp/"
    server.should_exit = True
    thread.join(timeout=30)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def archive(manifest: str, body: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("moorage.toml", manifest), ("agent.py", textwrap.dedent(body))):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def files_containing(root: Path, needle: bytes) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                if needle in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                continue
    return hits


async def test_agent_calls_external_mcp_server_through_the_host(runtime, store: Store, acme: str, weather,
                                                                 monkeypatch: pytest.MonkeyPatch):
    ws, url = weather
    principal = store.authenticate(acme)
    monkeypatch.setenv("MOORAGE_TEST_WEATHER_KEY", ws.secret)
    (runtime.config.data_dir / "mcp.toml").write_text(
        f'[tenants."{principal.tenant_id}".servers.weather]\nurl = "{url}"\n'
        'headers = { "X-Weather-Key" = "${MOORAGE_TEST_WEATHER_KEY}" }\n')
    # The manifest's own URL for `weather` is ignored (the host's wins); `nokey` is manifest-only: no credentials.
    manifest = ('[agent]\nname = "wx"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n'
                '[agent.mcp.weather]\nurl = "http://127.0.0.1:9/elsewhere"\n'
                f'[agent.mcp.nokey]\nurl = "{url}"\n[agent.mcp.down]\nurl = "http://127.0.0.1:{closed_port()}/mcp/"\n')
    await runtime.deploy(principal, archive(manifest, AGENT))
    ann = EntityKey("wx", "ann", "s1")

    result = await runtime.invoke(principal, ann, "Oslo")
    assert result.status == "done" and result.reply == "sunny in Oslo"
    assert ws.secret in ws.keys_seen  # the host did send the credential...
    again = await runtime.invoke(principal, ann, "Bergen")
    assert again.reply == "sunny in Bergen"
    assert ws.list_calls == 1  # ...and fetched the tool schemas once for the session

    tools = json.loads((await runtime.invoke(principal, ann, "tools")).reply)
    assert tools == [{"server": "weather", "name": "forecast", "description": "Tomorrow's weather",
                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    assert ws.list_calls == 1  # `weather` came from the cache; `nokey` was asked too but refused at the door

    refused_before = ws.refused
    nokey = await runtime.invoke(principal, ann, "nokey")
    assert nokey.reply.startswith("refused: ") and "nokey" in nokey.reply and ws.secret not in nokey.reply
    assert ws.refused > refused_before  # a server only the manifest names gets no credentials

    # A server that is down: the agent catches a typed error that names the failure, not the client's task group.
    down = json.loads((await runtime.invoke(principal, ann, "down")).reply)
    assert down["kind"] == "unavailable" and "'down'" in down["error"], down
    assert "ExceptionGroup" not in down["error"] and "ConnectError" in down["error"], down

    # The secret is nowhere inside the sandbox: not in its environment, not in any file it holds.
    env = (await runtime.invoke(principal, ann, "env")).reply
    assert "MOORAGE_TEST_WEATHER_KEY" not in env and ws.secret not in env
    assert files_containing(runtime.config.sandboxes_dir, ws.secret.encode()) == []

    spans = store.tenant(principal).spans.trace(again.trace_id)
    tool_spans = [s for s in spans if s.name == "mcp.tool"]
    assert len(tool_spans) == 1
    span = tool_spans[0]
    assert span.status == "ok" and span.attrs["mcp.server"] == "weather" and span.attrs["mcp.tool"] == "forecast"
    assert (span.attrs["agent"], span.attrs["user"], span.attrs["session"]) == ("wx", "ann", "s1")
    assert ws.secret not in json.dumps(span.attrs)
    await runtime.mcp.close()


def test_host_entry_wins_over_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MOORAGE_TEST_TOKEN", "s3cret")
    cfg = tmp_path / "mcp.toml"
    cfg.write_text('[tenants.t1.servers.crm]\nurl = "https://crm.example/mcp"\n'
                   'headers = { Authorization = "Bearer ${MOORAGE_TEST_TOKEN}" }\n')
    host = HostMcpConfig(cfg)
    assert host.servers("t2") == {}  # another tenant's servers and credentials are not this one's
    manifest = {"mcp": {"crm": {"url": "https://attacker.example/mcp"}, "docs": {"url": "https://docs.example/mcp"},
                        "bad": {"url": "file:///etc/passwd"}}}
    servers = servers_for(manifest, host.servers("t1"))
    assert servers["crm"] == McpServer("crm", "https://crm.example/mcp", {"Authorization": "Bearer s3cret"})
    assert servers["docs"] == McpServer("docs", "https://docs.example/mcp", {})
    assert "bad" not in servers
