"""The shared request machinery, over a real server and store: auth, errors, idempotency, traces, limits."""

from __future__ import annotations

import json

import httpx

from moorage.store import Scope, Store


def problem_ok(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and body["type"].startswith("https://moorage.dev/problems/")
    assert body["title"] and body["detail"]
    assert body["trace_id"] == r.headers["x-trace-id"]
    assert "Traceback" not in r.text
    return body


def test_every_response_has_a_trace_id_recorded_as_a_span(live, acme):
    with live.client(acme) as c:
        r = c.get("/v1/agents")
        assert r.status_code == 200 and r.json() == {"data": [], "next_cursor": None}
        trace_id = r.headers["x-trace-id"]
        assert len(trace_id) == 32
        t = c.get(f"/v1/traces/{trace_id}").json()
        assert [s["name"] for s in t["spans"]] == ["GET /v1/agents"]
        assert t["spans"][0]["attrs"]["http.status_code"] == 200
        assert c.get("/does-not-exist").headers["x-trace-id"]


def test_no_credential_bad_credential_and_unknown_key(live, acme):
    with live.client() as c:
        body = problem_ok(c.get("/v1/agents"), 401)
        assert "Authorization" in body["hint"]
        problem_ok(c.get("/v1/agents", headers={"Authorization": "Basic abc"}), 401)
        problem_ok(c.get("/v1/agents", headers={"Authorization": "Bearer mrg_not-a-key"}), 401)
        problem_ok(c.get("/v1/agents", headers={"Authorization": "Bearer mrgu_forged.sig"}), 401)


def test_unknown_route_405_and_malformed_json(live, acme):
    with live.client(acme) as c:
        problem_ok(c.get("/v2/nothing"), 404)
        problem_ok(c.put("/v1/agents"), 405)
        problem_ok(c.post("/v1/keys", content=b"{not json", headers={"content-type": "application/json"}), 422)
        problem_ok(c.post("/v1/keys", json=[1, 2]), 422)
        problem_ok(c.post("/v1/keys", json={"scopes": ["root"]}), 422)
        problem_ok(c.post("/v1/keys", content=b"scopes=admin", headers={"content-type": "text/plain"}), 415)


def test_oversized_bodies_are_refused(live, acme):
    with live.client(acme) as c:
        big = json.dumps({"scopes": ["invoke"], "label": "x" * (2 << 20)})
        problem_ok(c.post("/v1/keys", content=big, headers={"content-type": "application/json"}), 413)
        huge = b"\x1f\x8b" + b"0" * (65 << 20)
        problem_ok(c.post("/v1/agents/a1/deployments", content=huge, headers={"content-type": "application/gzip"}), 413)

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(3):
                yield b"x" * (1 << 20)

        problem_ok(c.post("/v1/keys", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_key_scopes_are_enforced_and_revocation_applies(live, acme):
    with live.client(acme) as admin:
        inv = admin.post("/v1/keys", json={"scopes": ["invoke"], "label": "app"}).json()
        assert inv["secret"].startswith("mrg_") and inv["scopes"] == ["invoke"]
        listed = admin.get("/v1/keys").json()["data"]
        assert {k["id"] for k in listed} >= {inv["id"]} and all(k["secret"] is None for k in listed)
    with live.client(inv["secret"]) as c:
        assert c.get("/v1/models").status_code == 200
        problem_ok(c.get("/v1/agents"), 403)  # reading the tenant needs the read scope (test_scopes.py walks them all)
        problem_ok(c.get("/v1/keys"), 403)
        problem_ok(c.post("/v1/keys", json={"scopes": ["admin"]}), 403)
        problem_ok(c.post("/v1/agents/a1/users/u1/tokens", json={}), 403)
    with live.client(acme) as admin:
        assert admin.delete(f"/v1/keys/{inv['id']}").json() == {"revoked": inv["id"]}
        problem_ok(admin.delete(f"/v1/keys/{inv['id']}"), 404)
    with live.client(inv["secret"]) as c:
        problem_ok(c.get("/v1/agents"), 401)


def test_idempotency_key_replays_the_first_response(live, acme, store: Store):
    with live.client(acme) as c:
        h = {"Idempotency-Key": "create-key-1"}
        first = c.post("/v1/keys", json={"scopes": ["deploy"], "label": "ci"}, headers=h)
        again = c.post("/v1/keys", json={"scopes": ["deploy"], "label": "ci"}, headers=h)
        assert first.status_code == again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"]
        # The secret is shown once: the journal does not keep it, so a replay cannot reveal it again.
        assert first.json()["secret"] and again.json()["secret"] is None
        assert len([k for k in c.get("/v1/keys").json()["data"] if k["label"] == "ci"]) == 1
        # Same key, different request: refused rather than silently answered with the first response.
        problem_ok(c.post("/v1/keys", json={"scopes": ["invoke"], "label": "ci"}, headers=h), 422)
        # Errors (4xx) are replayed too; a malformed key is refused.
        e1 = c.delete("/v1/keys/nope", headers={"Idempotency-Key": "del-1"})
        e2 = c.delete("/v1/keys/nope", headers={"Idempotency-Key": "del-1"})
        assert e1.status_code == e2.status_code == 404 and e2.headers["idempotent-replayed"] == "true"
        assert e2.headers["content-type"] == e1.headers["content-type"] == "application/problem+json"
        assert e2.json()["detail"] == e1.json()["detail"]
        problem_ok(c.post("/v1/keys", json={"scopes": ["deploy"]}, headers={"Idempotency-Key": "bad key"}), 422)
    ts = store.tenant(store.authenticate(acme))
    entries = [j for j in ts.journal.list() if j.key.startswith("http:")]
    assert entries and all("mrg_" not in json.dumps(j.result) for j in entries)


def test_pagination_with_cursor(live, acme, store: Store):
    ts = store.tenant(store.authenticate(acme))
    for i in range(7):
        ts.agents.create(f"agent-{i}")
    ts.events.append_many(Scope.for_user("agent-0", "u1"), [])
    with live.client(acme) as c:
        seen, cursor = [], None
        while True:
            page = c.get("/v1/agents", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
            seen += [a["name"] for a in page["data"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == [f"agent-{i}" for i in range(7)]
        problem_ok(c.get("/v1/agents", params={"limit": 0}), 422)
        problem_ok(c.get("/v1/agents", params={"limit": "x"}), 422)
        problem_ok(c.get("/v1/agents", params={"cursor": "%%%"}), 422)


def test_runtime_routes_say_503_without_a_runtime(live, acme, store: Store):
    store.tenant(store.authenticate(acme)).agents.create("helper")
    with live.client(acme) as c:
        body = problem_ok(c.post("/v1/agents/helper/invoke", json={"message": "hi", "user": "u1"}), 503)
        assert "runtime" in body["detail"]


def test_operator_creates_tenants_with_the_operator_token(live, acme):
    with live.client() as c:
        problem_ok(c.post("/v1/tenants", json={"name": "initech"}), 401)
        problem_ok(c.post("/v1/tenants", json={"name": "initech"}, headers={"Authorization": f"Bearer {acme}"}), 401)
        r = c.post("/v1/tenants", json={"name": "initech"}, headers={"Authorization": f"Bearer {live.operator_token}"})
        assert r.status_code == 201, r.text
        secret = r.json()["api_key"]["secret"]
    with live.client(secret) as c:
        assert c.get("/v1/agents").json()["data"] == []
    assert (live.data_dir / "api" / "operator-token").stat().st_mode & 0o077 == 0


def test_metrics_have_no_tenant_labels(live, acme, store: Store):
    ts = store.tenant(store.authenticate(acme))
    ts.agents.create("secret-agent-name")
    ts.sandboxes.create(Scope.for_user("secret-agent-name", "u1"), state="sleeping")
    with live.client(acme) as c:
        c.get("/v1/agents/secret-agent-name")
        c.get("/v1/agents/nope")
        problem_ok(c.get("/metrics"), 401)  # host-wide figures: not for a tenant key
    metrics_token = (live.data_dir / "api" / "metrics-token").read_text().strip()
    with live.client(metrics_token) as c:
        text = c.get("/metrics").text
    assert 'moorage_instances{state="sleeping"} 1.0' in text
    assert 'moorage_http_requests_total{method="GET",route="/v1/agents/{agent}",status="404"} 1.0' in text
    assert 'moorage_errors_total{code="not-found"}' in text
    assert "secret-agent-name" not in text and acme not in text and ts.tenant_id not in text
