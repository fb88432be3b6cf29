"""docs/sdk.md's paragraph on a backend's key: each SDK method it lists under a scope reaches a route that a key
with that scope may call, and every method examples/backend calls is listed, so a backend given a key with the
scopes the page names is not refused (end-user tokens and exec need `deploy`, which the page once left out)."""

from __future__ import annotations

import re
from pathlib import Path

from moorage.api.routes import all_endpoints
from moorage.client._api import Request
from tests.client.test_sdk_routes import route_of, sdk_requests, server_routes

ROOT = Path(__file__).resolve().parents[2]
SCOPES = ("provision", "invoke", "read", "deploy", "secrets", "admin")


def _listed() -> dict[str, str]:
    """method -> the scope the paragraph names it under."""
    text = " ".join((ROOT / "docs" / "sdk.md").read_text().split())
    para = text[text.index("A backend's key needs"):].split(" Keys can be limited", 1)[0]
    out: dict[str, str] = {}
    scope, depth = None, 0
    for m in re.finditer(r"`(\w+)`|[()]", para):  # scopes outside parentheses, the methods in them
        if m.group(0) in "()":
            depth += 1 if m.group(0) == "(" else -1
        elif depth == 0 and m.group(1) in SCOPES:
            scope = m.group(1)
        elif depth > 0 and scope:
            out[m.group(1)] = scope
    return out


def test_each_method_is_listed_under_a_scope_its_route_accepts(tmp_path: Path) -> None:
    listed = _listed()
    requests = {**sdk_requests(), "stream": Request("POST", "/v1/agents/a1/invoke")}
    routes = server_routes(tmp_path)
    endpoints = {(ep.method, ep.path): ep for ep in all_endpoints()}
    wrong = {}
    for method, scope in listed.items():
        assert method in requests, f"docs/sdk.md lists {method!r}, which the SDK does not have"
        route = route_of(routes, requests[method])
        ep = endpoints[(requests[method].method, route.path)]
        if scope not in ep.scopes:
            wrong[method] = f"listed under {scope!r}, but {ep.method} {ep.path} takes {sorted(ep.scopes)}"
    assert wrong == {}


def test_every_method_the_example_backend_calls_is_listed() -> None:
    called = set(re.findall(r"(?<![/\w])sdk\.(\w+)", (ROOT / "examples" / "backend" / "app.py").read_text()))
    called -= {"paginate", "close", "settings"}  # not routes
    assert {"issue_user_token", "exec", "put_user", "invoke_async"} <= called
    assert sorted(called - set(_listed())) == []
