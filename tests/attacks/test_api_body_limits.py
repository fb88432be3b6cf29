"""A hostile tenant streams endless and deeply nested bodies: every route counts bytes as they arrive and
answers 413 (or 400 for nesting) while host memory stays flat; ids with a trailing newline are refused.
"""

from __future__ import annotations

import httpx
import pytest

from moorage.api.jsonbody import MAX_JSON_DEPTH
from moorage.api.mcp import MCP_BODY_LIMIT
from moorage.api.routing import JSON_BODY_LIMIT
from moorage.errors import InvalidInput, TenantScopeError
from moorage.sandbox.base import validate_id
from moorage.store import Store
from moorage.store.base import check_tenant_id
from moorage.store.model import check_id
from tests.api.conftest import LiveServer
from tests.attacks.api_support import MIB, peak_rss_growth, stream_endless_body
from tests.attacks.api_support import server, sqlite_store, tenant_key  # noqa: F401 - fixtures, found by name

#: Peak host memory an endless body may add before it is refused (the limits themselves are 1-2 MiB).
RSS_BOUND = 50 * MIB
MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def _problem(r: httpx.Response | object, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"].endswith("/" + code)


@pytest.fixture
def agent(sqlite_store: Store, tenant_key: str) -> str:
    ts = sqlite_store.tenant(sqlite_store.authenticate(tenant_key))
    ts.agents.create("echo")
    ts.agent_users.put("echo", "alice")  # a users = "existing" agent issues tokens to its users only
    return "echo"


def test_an_endless_chunked_mcp_body_gets_413_and_memory_stays_flat(server: LiveServer, tenant_key: str,
                                                                   agent: str) -> None:
    with peak_rss_growth() as growth:
        answer = stream_endless_body(server.url, f"/mcp/{agent}",
                                     {"Authorization": f"Bearer {tenant_key}", **MCP_HEADERS})
    assert answer.status == 413, answer.body
    assert b"payload-too-large" in answer.body
    assert answer.sent >= MCP_BODY_LIMIT  # it was refused for its size, not for anything else
    assert growth.bytes < RSS_BOUND, f"host memory grew {growth.bytes >> 20} MiB"


def test_an_endless_chunked_json_body_gets_413(server: LiveServer, tenant_key: str) -> None:
    with peak_rss_growth() as growth:
        answer = stream_endless_body(server.url, "/v1/keys", {"Authorization": f"Bearer {tenant_key}",
                                                              "Content-Type": "application/json"})
    assert answer.status == 413 and answer.sent >= JSON_BODY_LIMIT
    assert growth.bytes < RSS_BOUND


def test_an_endless_body_to_a_route_that_reads_none_is_not_buffered(server: LiveServer) -> None:
    with peak_rss_growth() as growth:
        answer = stream_endless_body(server.url, "/openapi.json", {})
    assert answer.status == 405
    assert growth.bytes < RSS_BOUND


def test_an_oversized_mcp_body_with_its_length_declared_is_refused(server: LiveServer, tenant_key: str,
                                                              agent: str) -> None:
    with server.client(tenant_key, **MCP_HEADERS) as c:
        r = c.post(f"/mcp/{agent}", content=b"[" * (MCP_BODY_LIMIT + 1))
        _problem(r, 413, "payload-too-large")


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 500_000])
def test_deeply_nested_json_is_a_400_never_a_500(server: LiveServer, tenant_key: str, agent: str, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    with server.client(tenant_key, **MCP_HEADERS) as c:
        body = b'{"scopes": ["invoke"], "label": ' + nested + b"}"
        if len(body) <= JSON_BODY_LIMIT:
            _problem(c.post("/v1/keys", content=body), 400, "json-too-deep")
        mcp = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
        if len(mcp) <= MCP_BODY_LIMIT:
            _problem(c.post(f"/mcp/{agent}", content=mcp), 400, "json-too-deep")
        else:
            _problem(c.post(f"/mcp/{agent}", content=mcp), 413, "payload-too-large")
        # The server is fine afterwards.
        assert c.get("/v1/agents").status_code == 200


def test_json_within_the_depth_limit_is_served(server: LiveServer, tenant_key: str) -> None:
    inner = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    with server.client(tenant_key) as c:
        r = c.post("/v1/keys", content=f'{{"scopes": ["invoke"], "label": {inner}}}'.encode(),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "label" in r.text  # parsed, then refused by the route for its type


@pytest.mark.parametrize("bad", ["alice\n", "alice\r\n", "alice\n\n"])
def test_an_id_with_a_trailing_newline_is_not_another_user(server: LiveServer, tenant_key: str, agent: str,
                                                         bad: str) -> None:
    with pytest.raises(InvalidInput):
        check_id(bad, "user id")
    with pytest.raises(InvalidInput):
        validate_id(bad.lower())
    with pytest.raises(TenantScopeError):
        check_tenant_id("0" * 32 + "\n")
    with server.client(tenant_key) as c:
        assert c.post(f"/v1/agents/{agent}/users/alice/tokens", json={}).status_code == 201
        _problem(c.post(f"/v1/agents/{agent}/users/{bad.replace(chr(10), '%0A').replace(chr(13), '%0D')}/tokens",
                        json={}), 422, "invalid-input")
