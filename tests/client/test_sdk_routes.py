"""Every SDK method speaks to a route the server has (its method and path), and every public route a backend uses
has an SDK method: checked against the app's own routing table, so a route renamed on one side fails here."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from starlette.routing import Match

from moorage.api.app import create_app
from moorage.client._api import Api, Request
from moorage.config import Config
from moorage.store import open_store

#: Routes that are not a backend's to call through the SDK, and why.
NOT_IN_SDK = {
    ("POST", "/v1/tenants"): "the operator's (`moorage store`/`moorage up`), with the operator token",
    ("GET", "/v1/tenants"): "the operator's (`moorage store tenants`), with the operator token",
    ("GET", "/v1/tenants/{tenant}/limits"): "the operator's (`moorage store tenant-limits`), with the operator token",
    ("PUT", "/v1/tenants/{tenant}/limits"): "the operator's (`moorage store tenant-limits`), with the operator token",
    ("DELETE", "/v1/tenants/{tenant}"): "the operator's (`moorage store delete-tenant`), with the operator token",
    ("POST", "/v1/chat/completions"): "for OpenAI clients (docs/api.md)",
    ("GET", "/v1/models"): "for OpenAI clients",
    ("POST", "/mcp"): "for MCP clients",
    ("POST", "/mcp/{agent}"): "for MCP clients",
    ("GET", "/metrics"): "for Prometheus",
    ("GET", "/readyz"): "for load balancers",
    ("GET", "/openapi.json"): "the description itself",
    ("GET", "/v1/executions/{execution_id}/output"): "read as a stream by follow_exec",
}
#: An agent's app is reached with any HTTP client (its own paths, methods and bodies), not typed methods.
APP_PREFIXES = ("/v1/agents/{agent}/users/{user}/app", "/v1/shared/{token}")

SAMPLES: dict[str, Any] = {"argv": ["true"], "scopes": ["read"], "to_users": ["u2"], "ttl_s": {"session": 1.0},
                           "source": b"x", "answer": "yes", "verb": "sleep"}
#: Methods whose arguments choose the route: each form besides the one built from SAMPLES.
FORMS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    *[("sandbox_action", ("sb1", verb), {}) for verb in ("wake", "checkpoint", "rollback", "fork")],
    ("list_secrets", ("a1",), {"user": "u1"}), ("set_secret", ("a1", "KEY", "v"), {"user": "u1"}),
    ("delete_secret", ("a1", "KEY"), {"user": "u1"}),
]


class Recorder(Api):
    """Builds each method's request and keeps it instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[Request] = []

    def _send(self, req: Request) -> Any:
        self.sent.append(req)
        return None


def sdk_requests() -> dict[str, Request]:
    out = {}
    for name, fn in inspect.getmembers(Api, inspect.isfunction):
        if name.startswith("_"):
            continue
        rec = Recorder()
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.name != "self" and p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
        getattr(rec, name)(*[SAMPLES.get(p.name, "a1") for p in params])
        assert len(rec.sent) == 1, name
        out[name] = rec.sent[0]
    for name, args, kwargs in FORMS:
        rec = Recorder()
        getattr(rec, name)(*args, **kwargs)
        out[f"{name}{args}{kwargs}"] = rec.sent[0]
    return out


def server_routes(tmp_path: Path) -> list[Any]:
    cfg = Config(data_dir=tmp_path / "data")
    store = open_store(cfg)
    try:
        app = create_app(store, cfg)
    finally:
        store.close()
    return [r for r in app.routes if getattr(r, "methods", None)]


def route_of(routes: list[Any], req: Request) -> Any:
    scope = {"type": "http", "method": req.method, "path": req.path.split("?")[0]}
    full = [r for r in routes if r.matches(scope)[0] == Match.FULL]
    return full[0] if full else None


def test_every_sdk_method_reaches_a_route_of_the_server(tmp_path: Path) -> None:
    routes = server_routes(tmp_path)
    requests = sdk_requests()
    assert {"invoke", "set_secret", "create_share_link", "fleet"} <= set(requests)
    unmatched = {name: f"{r.method} {r.path}" for name, r in requests.items() if route_of(routes, r) is None}
    assert unmatched == {}, f"SDK methods whose route the server does not have: {unmatched}"
    # A method's request never falls into an app's catch-all route (that would be the user's app answering).
    into_apps = [n for n, r in requests.items() if route_of(routes, r).path.startswith(APP_PREFIXES)]
    assert into_apps == []


def test_every_public_route_has_an_sdk_method(tmp_path: Path) -> None:
    routes = server_routes(tmp_path)
    covered = {(req.method, route_of(routes, req).path) for req in sdk_requests().values()}
    missing = []
    for r in routes:
        if r.path.startswith(APP_PREFIXES):
            continue
        for method in sorted(r.methods - {"HEAD"}):
            if (method, r.path) not in covered and (method, r.path) not in NOT_IN_SDK:
                missing.append(f"{method} {r.path}")
    assert missing == [], f"routes without an SDK method (add one, or say why in NOT_IN_SDK): {missing}"
    # The exceptions are routes that exist: a removed route leaves no stale excuse behind.
    paths = {(m, r.path) for r in routes for m in r.methods}
    assert set(NOT_IN_SDK) <= paths
