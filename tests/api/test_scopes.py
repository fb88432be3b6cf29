"""Key scopes, walked over the app's own route table: every route x every key scope is allowed exactly where the
route declares it, with real ids of the caller's tenant so the runtime's own checks are reached and must agree.
Keys limited to one agent reach that agent only."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from moorage.api.routes import all_endpoints
from moorage.store import Store
from moorage.store.model import API_KEY_SCOPES
from tests.api.conftest import aclient, agent_archive
from tests.api.test_cross_tenant import _PARAM, WEBSOCKET, app_routes, body_for, send

GZ = {"content-type": "application/gzip"}


def fill(path: str, ids: dict[str, Any]) -> str:
    """The path with its parameters filled from ``ids`` (a parameter a newer route adds gets a placeholder)."""
    return _PARAM.sub(lambda m: str(ids.get(m.group(1), f"no-{m.group(1)}")), path)


def test_every_tenant_route_declares_a_key_scope():
    for ep in all_endpoints():
        if ep.auth == "tenant":
            assert ep.scope in API_KEY_SCOPES, f"{ep.method} {ep.path}"
            assert "admin" in ep.scopes and ep.scopes <= set(API_KEY_SCOPES)


async def _plant(c: httpx.AsyncClient, tmp_path: Path, store: Store, admin: str) -> dict[str, Any]:
    assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
    turn = (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u1"})).json()
    hook = (await c.post("/v1/agents/echo/webhooks", json={"url": "http://127.0.0.1:9/hook"})).json()
    waiting = (await c.post("/v1/agents/echo/invoke", json={"message": "approve", "user": "u1"})).json()
    assert waiting["status"] == "waiting"
    ex = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "later", "user": "u1"})
    assert ex.status_code == 202, ex.text
    ts = store.tenant(store.authenticate(admin))
    delivery = ts.deliveries.list(hook["id"])[0]
    return {"agent": "echo", "user": "u1", "run_id": waiting["run_id"], "trace_id": turn["trace_id"],
            "sandbox_id": ts.sandboxes.list()[0].id, "webhook_id": hook["id"], "delivery_id": delivery.id,
            "execution_id": ex.json()["id"], "key_id": "filled-per-call"}


async def _fresh_ids(c: httpx.AsyncClient, method: str, path: str, ids: dict[str, Any]) -> dict[str, Any]:
    """Deleting routes get a resource of their own, so one call does not take away what the next one needs."""
    out = dict(ids)
    if method == "DELETE" and "{key_id}" in path:
        out["key_id"] = (await c.post("/v1/keys", json={"scopes": ["read"]})).json()["id"]
    if method == "DELETE" and "{webhook_id}" in path:
        out["webhook_id"] = (await c.post("/v1/agents/echo/webhooks", json={"url": "http://127.0.0.1:9/x"})).json()["id"]
    if method == "DELETE" and path.endswith("/users/{user}"):
        out["user"] = f"gone-{uuid.uuid4().hex[:8]}"
        assert (await c.put(f"/v1/agents/echo/users/{out['user']}", json={})).status_code == 201
    if method == "DELETE" and path == "/v1/agents/{agent}":
        out["agent"] = f"gone-{uuid.uuid4().hex[:8]}"  # the scope is checked first: the planted agent stays
    return out


async def test_every_route_allows_exactly_its_declared_scopes(live_rt, store: Store, acme: str, tmp_path: Path):
    declared = {(ep.method, ep.path): ep for ep in all_endpoints()}
    # A WebSocket route is authorized by the declaration of the GET route of its path.
    declared |= {(WEBSOCKET, p): ep for (m, p), ep in declared.items() if m == "GET"}
    async with aclient(live_rt, acme) as admin:
        ids = await _plant(admin, tmp_path, store, acme)
        keys = {s: (await admin.post("/v1/keys", json={"scopes": [s], "label": s})).json()["secret"]
                for s in API_KEY_SCOPES}
        # Admin last: the narrow key that a route allows must be the one that reaches the runtime's own check.
        order = [s for s in API_KEY_SCOPES if s != "admin"] + ["admin"]
        walked = 0
        async with httpx.AsyncClient(base_url=live_rt.url, timeout=120) as c:
            for method, path in app_routes(live_rt.app):
                ep = declared.get((method, path))
                if ep is None or ep.auth != "tenant":
                    continue
                for scope in order:
                    call_ids = await _fresh_ids(admin, method, path, ids)
                    kw = body_for(method, path, call_ids)
                    kw["headers"] = {"Authorization": f"Bearer {keys[scope]}", **kw.get("headers", {})}
                    r = await send(c, method, fill(path, call_ids), **kw)
                    what = f"{scope} key: {method} {path} -> {r.status_code} {r.text[:200]}"
                    if scope in ep.scopes:
                        assert r.status_code != 403, what
                    else:
                        assert r.status_code == 403 and r.json()["type"].endswith("/tenant-scope"), what
                    walked += 1
    assert walked == len(API_KEY_SCOPES) * sum(1 for m, p in app_routes(live_rt.app)
                                                if declared.get((m, p)) and declared[(m, p)].auth == "tenant")


async def test_invoke_only_keys_no_longer_read_everything(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as admin:
        assert (await admin.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        invoke = (await admin.post("/v1/keys", json={"scopes": ["invoke"]})).json()["secret"]
    async with aclient(live_rt, invoke) as c:
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u"})).status_code == 200
        for path in ("/v1/workflows", "/v1/traces", "/v1/usage", "/v1/sandboxes", "/v1/agents/echo/users/u/events"):
            assert (await c.get(path)).status_code == 403, path


async def test_keys_limited_to_one_agent(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as admin:
        for name in ("echo", "other"):
            r = await admin.post(f"/v1/agents/{name}/deployments", content=agent_archive(tmp_path, name), headers=GZ)
            assert r.status_code == 201
        r = await admin.post("/v1/keys", json={"scopes": ["invoke", "read", "provision"], "agent": "echo"})
        assert r.status_code == 201 and r.json()["agent"] == "echo"
        key = r.json()["secret"]
        listed = {k["id"]: k for k in (await admin.get("/v1/keys")).json()["data"]}
        assert listed[r.json()["id"]]["agent"] == "echo" and listed[r.json()["id"]]["scopes"] == ["invoke", "provision", "read"]
        other_ex = (await admin.post("/v1/agents/other/invoke?async=true", json={"message": "x", "user": "u"})).json()
    async with aclient(live_rt, key) as c:
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u"})).json()["reply"] == "echo: hi"
        assert (await c.put("/v1/agents/echo/users/u2", json={})).status_code == 201
        assert (await c.get("/v1/agents/echo/users/u2")).status_code == 200
        for r in (await c.post("/v1/agents/other/invoke", json={"message": "hi", "user": "u"}),
                  await c.get("/v1/agents/other/users/u"),
                  await c.get("/v1/sandboxes"),  # spans agents: refused, not filtered
                  await c.post("/v1/chat/completions", json={"model": "other", "user": "u",
                                                             "messages": [{"role": "user", "content": "x"}]})):
            assert r.status_code == 403, r.text
        chat = await c.post("/v1/chat/completions", json={"model": "echo", "user": "u",
                                                          "messages": [{"role": "user", "content": "yo"}]})
        assert chat.json()["choices"][0]["message"]["content"] == "echo: yo"
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["echo"]
        assert (await c.get(f"/v1/executions/{other_ex['id']}")).status_code == 404
