"""The cross-tenant route suite: every route the app serves, attacked with another tenant's key, the victim's
real ids, forged tenant/user headers, end-user tokens of another user or agent, and no credential.

Routes are enumerated from the app itself, so a new route cannot escape. Nothing the victim stored may
appear in any response, and the victim's data must be unchanged afterwards. Runs on both store backends.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
from starlette.routing import Route, WebSocketRoute

from moorage.store import Scope, Store
from tests.api.conftest import aclient, agent_archive

PUBLIC = {"/healthz", "/readyz", "/openapi.json"}  # /metrics needs the metrics or operator token: attacked like the rest
# Share links need no key: the token in the path is the credential (a wrong one is a 404; tests/app proves
# a link opens one user's app and nothing else).
PUBLIC |= {"/v1/shared/{token}", "/v1/shared/{token}/{path:path}"}
PLANT = f"PLANTED-{uuid.uuid4().hex}"
_PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")


async def plant_victim(live, store: Store, globex: str, tmp_path: Path) -> dict[str, Any]:
    """Give the victim tenant one of everything, each marked with the planted string where it can hold text."""
    async with aclient(live, globex) as c:
        r = await c.post("/v1/agents/vagent/deployments", content=agent_archive(tmp_path, "vagent"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        turn = (await c.post("/v1/agents/vagent/invoke", json={"message": f"hello {PLANT}", "user": "vuser"})).json()
        hook = (await c.post("/v1/agents/vagent/webhooks", json={"url": "http://127.0.0.1:9/victim"})).json()
        execution = (await c.post("/v1/agents/vagent/invoke?async=true", json={"message": "later", "user": "vuser"})).json()
        # 200: the first turn of this users = "auto" agent already registered vuser with it.
        assert (await c.put("/v1/agents/vagent/users/vuser", json={"metadata": {"note": PLANT}})).status_code == 200
        while (await c.get(f"/v1/executions/{execution['id']}")).json()["status"] != "succeeded":
            await asyncio.sleep(0.05)
        waiting = (await c.post("/v1/agents/vagent/invoke", json={"message": "approve", "user": "vuser"})).json()
        assert waiting["status"] == "waiting"
        fact = await c.post("/v1/agents/vagent/users/vuser/facts",
                            json={"subject": "user", "attribute": "code", "value": PLANT})
        assert fact.status_code == 201
        key = (await c.post("/v1/keys", json={"scopes": ["invoke"], "label": PLANT})).json()
        token = (await c.post("/v1/agents/vagent/users/vuser/tokens", json={})).json()["token"]
        other_user_token = (await c.post("/v1/agents/vagent/users/vother/tokens", json={})).json()["token"]
        retention = await c.put("/v1/agents/vagent/retention", json={"ttl_s": 86400})
        assert retention.json() == {"agent": "vagent", "ttl_s": 86400, "zero_retention": False}, retention.text
        tenant_retention = await c.put("/v1/retention", json={"ttl_s": {"session": 7 * 86400}})
        assert tenant_retention.json()["ttl_s"]["session"] == 7 * 86400, tenant_retention.text
    ts = store.tenant(store.authenticate(globex))
    sandbox = ts.sandboxes.list()[0]
    async with aclient(live, globex) as c:  # a detached exec whose kept output is the planted string
        r = await c.post(f"/v1/sandboxes/{sandbox.id}/exec", json={"argv": ["echo", PLANT], "detach": True})
        assert r.status_code == 202, r.text
        while (exec_view := (await c.get(r.headers["location"])).json())["status"] == "running":
            await asyncio.sleep(0.05)
        assert exec_view["stdout"] == PLANT + "\n"
    return {
        "agent": "vagent", "user": "vuser", "run_id": waiting["run_id"], "sandbox_id": sandbox.id,
        "trace_id": turn["trace_id"], "key_id": key["id"], "tenant_id": ts.tenant_id,
        "webhook_id": hook["id"], "execution_id": execution["id"], "exec_execution_id": exec_view["id"],
        "delivery_id": ts.deliveries.list(hook["id"])[0].id,
        "secrets": [globex, key["secret"], token, other_user_token, hook["secret"]], "token": token,
        "other_user_token": other_user_token,
    }


def snapshot(store: Store, globex: str) -> dict[str, Any]:
    ts = store.tenant(store.authenticate(globex))
    return {
        "agents": [(a.name, a.live_deployment, a.version) for a in ts.agents.list()],
        "keys": [(k.id, k.revoked_at) for k in ts.keys.list()],
        "facts": [(f.value, f.version) for f in ts.facts.list(Scope.for_user("vagent", "vuser"), include_closed=True)],
        "events": ts.events.count(Scope.session("vagent", "vuser", "default")),
        # vother's own token may legitimately run turns for vother; everything of vuser must stay as it was.
        "runs": sorted((r.id, r.status, r.version) for r in ts.runs.list(limit=1000) if r.scope.user == "vuser"),
        "sandboxes": [(s.id, s.state) for s in ts.sandboxes.list() if s.scope.user == "vuser"],
        # vother's token may run vother's first turn, which registers vother with this users = "auto" agent.
        "users": [(u.user, u.version) for u in ts.agent_users.list("vagent") if u.user != "vother"],
        "webhooks": [(h.id, h.url, h.version) for h in ts.webhooks.list()],
        "retention": ts.retention.agents(),
        "tenant_retention": ts.retention.get(),
        "agent_configs": [(a.name, a.config) for a in ts.agents.list()],
        "deliveries": [(d.id, d.status, d.version) for h in ts.webhooks.list() for d in ts.deliveries.list(h.id)],
    }


#: WebSocket routes are listed with this method: ``send`` makes their upgrade handshake (a refused one is an HTTP
#: answer like any other route's).
WEBSOCKET = "WEBSOCKET"
_UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}


async def send(c: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
    """``c.request``, or for a WebSocket route its handshake (a GET with the upgrade headers, no body)."""
    if method != WEBSOCKET:
        return await c.request(method, url, **kw)
    return await c.get(url, headers={**kw.get("headers", {}), **_UPGRADE})


def app_routes(app: Any) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if isinstance(route, WebSocketRoute):
            out.append((WEBSOCKET, route.path))
            continue
        assert isinstance(route, Route), f"unexpected route type {route!r}: add it to the suite"
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def fill(path: str, ids: dict[str, Any]) -> str:
    # A parameter no id names (a share token, an app's path) gets a placeholder.
    return _PARAM.sub(lambda m: str(ids.get(m.group(1), f"no-{m.group(1)}")), path)


def body_for(method: str, path: str, ids: dict[str, Any]) -> dict[str, Any]:
    if path.endswith("/deployments") and method == "POST":
        return {"content": b"\x1f\x8b" + b"\0" * 32, "headers": {"content-type": "application/gzip"}}
    if method in ("GET", "DELETE"):
        return {"params": {"path": "/", "q": "hello", "user": ids["user"], "agent": ids["agent"]}}
    return {"json": {"message": "hello", "user": ids["user"], "session": "default", "name": "x", "scopes": ["admin"],
                     "number": 1, "answer": "yes", "subject": "user", "attribute": "code", "value": "stolen",
                     "model": ids["agent"], "messages": [{"role": "user", "content": "hello"}]}}


def assert_no_leak(r: httpx.Response, victim: dict[str, Any], what: str) -> None:
    text = r.text
    for needle in (PLANT, victim["tenant_id"], *victim["secrets"]):
        assert needle not in text, f"{what} leaked victim data ({needle[:12]}...): {text[:300]}"
    assert r.status_code < 500, f"{what}: {r.status_code} {text[:300]}"


async def test_no_route_crosses_tenants(live_rt, store: Store, acme: str, globex: str, tmp_path: Path):
    victim = await plant_victim(live_rt, store, globex, tmp_path)
    before = snapshot(store, globex)
    async with aclient(live_rt, acme) as c:
        own_token = (await c.post("/v1/agents/vagent/users/vuser/tokens", json={})).json()
        assert own_token["type"].endswith("not-found")  # acme has no agent of that name: no token for it
        r = await c.post("/v1/agents/aagent/deployments", content=agent_archive(tmp_path, "aagent"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201
        acme_user_token = (await c.post("/v1/agents/aagent/users/vuser/tokens", json={})).json()["token"]

    forged = {"X-Tenant-Id": victim["tenant_id"], "X-Moorage-Tenant": victim["tenant_id"],
              "X-Moorage-User": "vuser", "X-Forwarded-User": "vuser", "X-Moorage-Agent": "vagent"}
    attackers = {
        "other tenant's admin key": {"Authorization": f"Bearer {acme}"},
        "other tenant's key + forged headers": {"Authorization": f"Bearer {acme}", **forged},
        "end-user token of another tenant (same user and agent names)": {"Authorization": f"Bearer {acme_user_token}", **forged},
        "end-user token of another user of the same agent": {"Authorization": f"Bearer {victim['other_user_token']}"},
        "no credential": {},
        "no credential + forged headers": forged,
    }
    routes = app_routes(live_rt.app)
    assert len(routes) >= 30
    # "name": a secret the victim could hold (routes under /secrets/{name}); random ids get a malformed one.
    guessed = {**victim, "sandbox_id": victim["sandbox_id"], "key_id": victim["key_id"], "name": "GITHUB_TOKEN"}
    random_ids = {k: uuid.uuid4().hex for k in ("agent", "user", "run_id", "sandbox_id", "trace_id", "key_id",
                                                 "webhook_id", "execution_id", "delivery_id", "name")}
    tried = 0
    async with httpx.AsyncClient(base_url=live_rt.url, timeout=120) as c:
        for who, headers in attackers.items():
            for ids in (guessed, random_ids):
                for method, path in routes:
                    url = fill(path, ids)
                    kw = body_for(method, path, ids)
                    kw["headers"] = {**headers, **kw.get("headers", {})}
                    r = await send(c, method, url, **kw)
                    tried += 1
                    what = f"{who}: {method} {path}"
                    assert_no_leak(r, victim, what)
                    if path in PUBLIC:
                        continue
                    if "Authorization" not in headers:
                        assert r.status_code == 401, what
                    elif who.startswith("end-user token of another user") and ids is guessed and "{user}" in path:
                        assert r.status_code == 403, f"{what}: {r.status_code}"
                    elif _PARAM.search(path) and ids is guessed and who != "end-user token of another user of the same agent":
                        assert r.status_code in (401, 403, 404, 422), f"{what}: {r.status_code} {r.text[:200]}"
    assert tried == len(attackers) * 2 * len(routes)
    # Executions have one namespace: every execution route is also tried with the victim's detached exec.
    exec_ids = {**guessed, "execution_id": victim["exec_execution_id"]}
    async with httpx.AsyncClient(base_url=live_rt.url, timeout=120) as c:
        for who, headers in attackers.items():
            for method, path in routes:
                if "{execution_id}" not in path:
                    continue
                kw = body_for(method, path, exec_ids)
                r = await send(c, method, fill(path, exec_ids), **kw, headers=headers)
                assert_no_leak(r, victim, f"{who}: {method} {path} (exec)")
                assert r.status_code in (401, 403, 404, 422), f"{who}: {method} {path} (exec): {r.status_code}"
    assert snapshot(store, globex) == before

    # The victim still sees its own data (the suite did not pass by breaking the routes).
    async with aclient(live_rt, globex) as c:
        facts = (await c.get("/v1/agents/vagent/users/vuser/facts")).json()["data"]
        assert [f["value"] for f in facts] == [PLANT]
        assert (await c.get(f"/v1/traces/{victim['trace_id']}")).status_code in (200, 404)
        assert (await c.get(f"/v1/workflows/{victim['run_id']}")).json()["run"]["status"] == "waiting"
