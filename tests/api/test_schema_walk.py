"""A realistic walk through the success path of (nearly) every operation with the real runtime: each answer's
status is one the operation documents, its content type is documented for that status, its body validates against
the documented schema, and every field it has is named there (at the top level, and in documented objects and list
items below it): an undocumented field is how a client generated from /openapi.json breaks. The requests it sends
are ones the document allows, a few realistic failures answer documented problems, and a streamed turn's last
event is a TurnResult. Every mismatch is collected and reported in one assertion."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.api.conftest import aclient

#: Operations the walk does not reach, each with why.
NOT_WALKED = {
    # Methods of an app's own HTTP server, relayed as the app answers them (GET and POST are walked).
    "appPut": "relayed to the agent's app like appPost",
    "appPatch": "relayed to the agent's app like appPost",
    "appDelete": "relayed to the agent's app like appPost",
    "appOptions": "relayed to the agent's app like appPost",
    "sharedPut": "relayed to the agent's app like sharedPost",
    "sharedPatch": "relayed to the agent's app like sharedPost",
    "sharedDelete": "relayed to the agent's app like sharedPost",
    "sharedOptions": "relayed to the agent's app like sharedPost",
}

#: Operations whose JSON request body is not theirs to describe.
BODY_NOT_DECLARED = {
    "appPost": "whatever the agent's app takes",
    "sharedPost": "whatever the agent's app takes",
}

# One agent does everything the walk needs: a JSON reply, a question for a human, and an app on port 8080.
AGENT = '''
import http.server, json, threading


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body, ctype):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/status"):
            self._send(200, json.dumps({"path": self.path}).encode(), "application/json")
        else:
            self._send(200, b"<!doctype html><p>a page</p>", "text/html; charset=utf-8")

    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(201, json.dumps({"len": len(data)}).encode(), "application/json")

    def log_message(self, *args):
        pass


def _serve():
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler).serve_forever()
    except OSError:
        pass


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    if message == "boom":
        raise RuntimeError("boom")
    if message == "json":
        return {"said": message, "words": [1, 2]}
    if message == "approve":
        draft = await ctx.step("draft", lambda: "draft-1")
        answer = await ctx.interrupt({"question": "ship it?", "draft": draft})
        return f"{draft} -> {answer}"
    if message.startswith("stream "):
        for word in message[len("stream "):].split():
            await ctx.emit("token", word + " ")
        return "streamed"
    return "echo: " + message
'''


def _archive(tmp_path: Path, version: str) -> bytes:
    import io
    import tarfile

    root = tmp_path / f"walk-src{version}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "walk"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(AGENT.replace("echo: ", f"echo{version}: "))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


class Walk:
    """Calls operations by their documented path and checks each answer against the document."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.mismatches: list[str] = []
        self.walked: set[str] = set()
        self.templates: list[tuple[re.Pattern[str], str]] = []
        for template in spec["paths"]:
            parts = re.split(r"({[^}]+})", template)
            rx = "".join(".*" if p == "{path}" else "[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
            self.templates.append((re.compile(f"^{rx}$"), template))
        # The most specific template first (fewest parameters), as a router would match literal segments first.
        self.templates.sort(key=lambda t: (t[1].count("{"), -len(t[1])))

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def operation(self, method: str, path: str) -> tuple[str, dict[str, Any]]:
        for rx, template in self.templates:
            if rx.match(path) and method.lower() in self.spec["paths"][template]:
                return template, self.spec["paths"][template][method.lower()]
        raise AssertionError(f"{method} {path} is no documented operation")

    def unnamed(self, body: Any, schema: dict[str, Any], where: str = "") -> list[str]:
        """Fields of ``body`` its schema does not name: at the top level always (a schema naming no field, other
        than one documented as whatever an app answers, names none), and below it inside documented objects."""
        schema = self.resolve(schema)
        for key in ("oneOf", "anyOf"):
            if key in schema:
                for branch in schema[key]:  # the branch the body is (a body no branch fits is reported already)
                    if jsonschema.Draft202012Validator({**branch, "components": self.spec["components"]}).is_valid(body):
                        return self.unnamed(body, branch, where)
                return []
        out: list[str] = []
        if isinstance(body, dict):
            props = schema.get("properties")
            if props is None and (where or "type" not in schema or schema.get("additionalProperties")):
                # A free-form object inside a documented one (metadata, config, a span's attrs, the summary of a
                # checkpoint: the agent's or the product's own keys), or an app's own answer.
                return []
            extra = set(body) - set(props or {})
            if extra and not schema.get("additionalProperties"):
                out.append(f"{where or '(body)'} has fields the schema does not name: {sorted(extra)}")
            for name, sub in (props or {}).items():
                if name in body:
                    out += self.unnamed(body[name], sub, f"{where}/{name}" if where else name)
        elif isinstance(body, list):
            items = self.resolve(schema.get("items", {}))
            for item in body:
                if isinstance(item, dict) and "properties" not in items and not {"oneOf", "anyOf"} & set(items):
                    out.append(f"{where}/* items are objects whose fields the schema does not name: {sorted(item)}")
                else:
                    out += self.unnamed(item, items, f"{where}/*")
        return out

    def check(self, r: httpx.Response, method: str, path: str, expect: int | None = None) -> None:
        """``expect``: the error status a realistic failure answers (its problem is checked as a body is)."""
        template, op = self.operation(method, path)
        label = f"{op['operationId']} ({method} {template})"
        documented = op["responses"]
        if expect is None:
            self.walked.add(op["operationId"])
            if r.status_code >= 400:
                self.mismatches.append(f"{label}: answered {r.status_code}, not a success: {r.text[:300]}")
                return
        elif r.status_code != expect:
            self.mismatches.append(f"{label}: answered {r.status_code}, the walk expected {expect}: {r.text[:300]}")
            return
        keys = (str(r.status_code), f"{r.status_code // 100}XX", *(("default",) if r.status_code >= 400 else ()))
        status = next((s for s in keys if s in documented), None)
        if status is None:
            self.mismatches.append(f"{label}: answered {r.status_code}, documents {sorted(documented)}")
            return
        content = documented[status].get("content", {})
        ctype = r.headers.get("content-type", "").split(";")[0].strip()
        if ctype not in content and {"*/*", ctype.split("/")[0] + "/*"} & set(content):
            return  # documented as any content (an app's own answer): nothing more to check
        if not content:
            if r.content:
                self.mismatches.append(f"{label}: {r.status_code} documents no body, answered {ctype or 'a body'}")
            return
        if ctype not in content:
            self.mismatches.append(f"{label}: {r.status_code} answered content type {ctype!r}, documents {sorted(content)}")
            return
        if not ctype.endswith("json"):
            return
        body = r.json()
        schema = content[ctype]["schema"]
        try:
            jsonschema.validate(body, {**schema, "components": self.spec["components"]})
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(body)"
            self.mismatches.append(f"{label}: {r.status_code} body at {where}: {e.message[:300]}")
        for problem in dict.fromkeys(self.unnamed(body, schema)):  # once per field path, not per list item
            self.mismatches.append(f"{label}: {r.status_code} body {problem}")

    def component(self, body: Any, name: str, label: str) -> None:
        """``body`` is the documented component ``name`` (e.g. a stream's last event, which carries a TurnResult)."""
        schema = {"$ref": f"#/components/schemas/{name}"}
        try:
            jsonschema.validate(body, {**schema, "components": self.spec["components"]})
        except jsonschema.ValidationError as e:
            self.mismatches.append(f"{label}: not a {name}: {e.message[:300]}")
        for problem in dict.fromkeys(self.unnamed(body, schema)):
            self.mismatches.append(f"{label}: {name} {problem}")

    async def __call__(self, c: httpx.AsyncClient, method: str, path: str, expect: int | None = None,
                       **kw: Any) -> httpx.Response:
        if "json" in kw:  # the walk's requests are ones the document allows
            template, op = self.operation(method, path.split("?")[0])
            schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if schema is None and op["operationId"] not in BODY_NOT_DECLARED:
                self.mismatches.append(f"{op['operationId']} ({method} {template}): documents no JSON request body")
            elif schema is not None:
                try:
                    jsonschema.validate(kw["json"], {**schema, "components": self.spec["components"]})
                except jsonschema.ValidationError as e:
                    self.mismatches.append(f"{op['operationId']} ({method} {template}): the request body "
                                           f"{kw['json']} is not documented: {e.message[:200]}")
        r = await c.request(method, path, **kw)
        self.check(r, method, path.split("?")[0], expect)
        return r


async def _poll(c: httpx.AsyncClient, path: str, done: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        body = (await c.get(path)).json()
        if done(body) or asyncio.get_running_loop().time() > deadline:
            return body
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_every_operation_answers_as_documented(live_rt, store, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt) as anon:  # the document the server serves (test_openapi.py: equal to the repo's)
        spec = (await anon.get("/openapi.json")).json()
    w = Walk(spec)
    gz = {"content-type": "application/gzip"}
    A, U = "/v1/agents/walk", "/v1/agents/walk/users/ada"

    async with aclient(live_rt) as anon, aclient(live_rt, live_rt.operator_token) as op:
        await w(anon, "GET", "/healthz")
        await w(anon, "GET", "/readyz")
        tenant = (await w(op, "POST", "/v1/tenants", json={"name": "walkers"})).json()
        assert tenant["api_key"]["secret"]
        assert (await w(op, "GET", "/v1/tenants/walkers/limits")).json()["limits"] == {}  # none of its own yet
        await w(op, "PUT", "/v1/tenants/walkers/limits", json={"storage_mib": 256})
        assert (await w(op, "GET", "/v1/tenants/walkers/limits")).json()["storage_mib"] == 256
        assert "walkers" in [t["name"] for t in (await w(op, "GET", "/v1/tenants")).json()["data"]]
        assert (await w(op, "DELETE", "/v1/tenants/walkers")).json()["deleted"] is True

    async with aclient(live_rt, acme) as c:
        # Keys.
        key = (await w(c, "POST", "/v1/keys", json={"scopes": ["read"], "label": "ro", "agent": "walk"})).json()
        await w(c, "GET", "/v1/keys")
        async with aclient(live_rt, key["secret"]) as ro:
            await w(ro, "GET", "/v1/whoami")
        await w(c, "DELETE", f"/v1/keys/{key['id']}")

        # Deploy twice, list, roll back, delete the newer (the agent stays the same code with another reply prefix).
        await w(c, "POST", f"{A}/deployments", content=_archive(tmp_path, ""), headers=gz)
        await w(c, "POST", f"{A}/deployments", content=_archive(tmp_path, "2"), headers=gz)
        await w(c, "GET", "/v1/agents")
        await w(c, "GET", A)
        await w(c, "GET", f"{A}/deployments")
        await w(c, "POST", f"{A}/rollback", json={})
        await w(c, "DELETE", f"{A}/deployments/2")  # no longer live after the rollback
        await w(c, "GET", "/v1/models")

        # Users.
        await w(c, "PUT", U, json={"metadata": {"plan": "pro"}})
        await w(c, "PUT", U, json={"metadata": {"plan": "pro"}})
        await w(c, "GET", U)
        await w(c, "GET", f"{A}/users", params={"metadata.plan": "pro"})
        await w(c, "PUT", f"{A}/users/bea?provision=true", json={})
        tok = (await w(c, "POST", f"{U}/tokens", json={"ttl_s": 600})).json()["token"]
        # Asked again with the same Idempotency-Key: the first answer replayed (a secret shown once is null then).
        for method, path, body in (("POST", "/v1/keys", {"scopes": ["read"]}), ("POST", f"{U}/tokens", {}),
                                   ("POST", f"{A}/invoke", {"message": "once", "user": "ada"}),
                                   ("POST", f"{A}/invoke?async=true", {"message": "once", "user": "ada"})):
            for _ in range(2):
                await w(c, method, path, json=body, headers={"idempotency-key": f"walk-{path}"})

        # Turns: plain, a JSON reply, streamed, through the chat facade, through MCP.
        turn = (await w(c, "POST", f"{A}/invoke", json={"message": "hello", "user": "ada"})).json()
        await w(c, "POST", f"{A}/invoke", json={"message": "json", "user": "ada", "session": "s1"})
        r = await w(c, "POST", f"{A}/invoke?stream=true", json={"message": "stream a b", "user": "ada"})
        frames = [f.split("\n") for f in r.text.split("\n\n") if f.startswith("event: ")]
        last = [json.loads(lines[1][len("data: "):]) for lines in frames if lines[0] == "event: done"]
        assert len(last) == 1, r.text
        w.component(last[0], "TurnResult", "invokeAgent (stream): the done event")
        await w(c, "POST", "/v1/chat/completions",
                json={"model": "walk", "user": "ada", "messages": [{"role": "user", "content": "hi"}]})
        await w(c, "POST", "/v1/chat/completions",
                json={"model": "walk", "user": "ada", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        r = await w(c, "POST", "/v1/chat/completions",
                    json={"model": "walk", "user": "ada", "messages": [{"role": "user", "content": "json"}]})
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"said": "json", "words": [1, 2]}
        r = await w(c, "POST", "/v1/chat/completions",
                    json={"model": "walk", "user": "ada", "stream": True, "messages": [{"role": "user", "content": "json"}]})
        assert '\\"said\\"' in r.text, r.text  # a JSON reply is streamed as its text too
        mcp_headers = {"accept": "application/json, text/event-stream", "x-moorage-user": "ada"}
        await w(c, "POST", "/mcp/walk", headers=mcp_headers,
                json={"jsonrpc": "2.0", "id": 0, "method": "initialize",
                      "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                 "clientInfo": {"name": "walk", "version": "1"}}})
        await w(c, "POST", "/mcp/walk", headers=mcp_headers,
                json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        await w(c, "POST", "/mcp/walk", headers=mcp_headers,
                json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
        async with aclient(live_rt, tok) as enduser:
            await w(enduser, "POST", "/mcp", headers={"accept": "application/json, text/event-stream"},
                    json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                          "params": {"name": "send_message", "arguments": {"message": "via mcp"}}})

        # A turn that asks a human: the run waits, is listed and inspected, then answered.
        waiting = (await w(c, "POST", f"{A}/invoke", json={"message": "approve", "user": "ada"})).json()
        assert waiting["status"] == "waiting", waiting
        await w(c, "GET", "/v1/workflows", params={"status": "waiting"})
        await w(c, "GET", f"/v1/workflows/{waiting['run_id']}")
        await w(c, "POST", f"/v1/workflows/{waiting['run_id']}/answer", json={"answer": "yes"})

        # Async turns: one that finishes, one that waits and is cancelled.
        ex = (await w(c, "POST", f"{A}/invoke?async=true", json={"message": "later", "user": "ada"})).json()
        await _poll(c, f"/v1/executions/{ex['id']}", lambda b: b["status"] not in ("queued", "running"))
        await w(c, "GET", f"/v1/executions/{ex['id']}")
        ex2 = (await w(c, "POST", f"{A}/invoke", headers={"prefer": "respond-async"},
                       json={"message": "approve", "user": "ada"})).json()
        asks = await _poll(c, f"/v1/executions/{ex2['id']}", lambda b: b["status"] not in ("queued", "running"))
        assert asks["status"] == "waiting" and asks["interrupt"], asks
        await w(c, "GET", f"/v1/executions/{ex2['id']}")
        await w(c, "POST", f"/v1/workflows/{ex2['id']}/cancel")
        await w(c, "GET", f"/v1/executions/{ex2['id']}")
        ex3 = (await w(c, "POST", f"{A}/invoke?async=true", json={"message": "boom", "user": "ada"})).json()
        failed = await _poll(c, f"/v1/executions/{ex3['id']}", lambda b: b["status"] not in ("queued", "running"))
        assert failed["status"] == "failed", failed
        await w(c, "GET", f"/v1/executions/{ex3['id']}")
        await w(c, "GET", "/v1/workflows", params={"agent": "walk"})

        # What an end-user token may read and do.
        async with aclient(live_rt, tok) as enduser:
            mine = (await w(enduser, "POST", f"{A}/invoke?async=true", json={"message": "mine"})).json()
            await _poll(enduser, f"/v1/executions/{mine['id']}", lambda b: b["status"] not in ("queued", "running"))
            await w(enduser, "GET", f"/v1/executions/{mine['id']}")
            await w(enduser, "GET", f"{A}/sessions")
            await w(enduser, "GET", f"{U}/events", params={"limit": 2})
            await w(enduser, "GET", "/v1/models")

        # Memory.
        await w(c, "GET", f"{A}/sessions", params={"user": "ada"})
        await w(c, "GET", f"{U}/events")
        await w(c, "GET", f"{U}/events/search", params={"q": "hello"})
        await w(c, "POST", f"{U}/facts", json={"subject": "ada", "attribute": "pet", "value": "Miso"})
        await w(c, "POST", f"{U}/facts", json={"subject": "ada", "attribute": "pet", "value": "Biscuit"})
        await w(c, "GET", f"{U}/facts")
        await w(c, "GET", f"{U}/facts", params={"include_closed": "true"})
        from moorage.memory import FactCandidate, SemanticMemory  # what an agent learns waits for confirmation
        from moorage.store import Scope

        mem = SemanticMemory(store.tenant(store.authenticate(acme)))
        learned = [mem.record(Scope.for_user("walk", "ada"), FactCandidate("ada", "city", v, v), origin="agent").fact.id
                   for v in ("Porto", "Faro")]
        await w(c, "GET", f"{U}/facts/pending", params={"limit": 1})
        await w(c, "POST", f"{U}/facts/{learned[0]}/confirm")
        await w(c, "POST", f"{U}/facts/{learned[1]}/reject")

        # Checkpoints of ada's instance.
        await w(c, "GET", f"{U}/checkpoints")
        ck = (await w(c, "POST", f"{U}/checkpoints", json={"name": "before"})).json()
        await w(c, "POST", f"{A}/invoke", json={"message": "after the checkpoint", "user": "ada"})
        await w(c, "POST", f"{U}/checkpoints/{ck['id']}/rollback", json={})
        await w(c, "POST", f"{U}/checkpoints/{ck['id']}/fork", json={"to_user": "ada-copy"})

        # Sandboxes.
        boxes = (await w(c, "GET", "/v1/sandboxes", params={"agent": "walk"})).json()["data"]
        sid = next(b["id"] for b in boxes if b["scope"].endswith("/ada"))
        await w(c, "GET", f"/v1/sandboxes/{sid}")
        await w(c, "POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "echo hi > note.txt; pwd"]})
        cwd = (await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["pwd"]})).json()["stdout"].strip()
        await w(c, "GET", f"/v1/sandboxes/{sid}/files", params={"path": cwd})
        await w(c, "GET", f"/v1/sandboxes/{sid}/files/content", params={"path": f"{cwd}/note.txt"})
        job = (await w(c, "POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "30"], "detach": True})).json()
        await w(c, "GET", f"/v1/executions/{job['id']}")
        await w(c, "POST", f"/v1/executions/{job['id']}/cancel")
        await w(c, "GET", f"/v1/executions/{job['id']}/output")
        box_ck = (await w(c, "POST", f"/v1/sandboxes/{sid}/checkpoint", json={"label": "box"})).json()
        await w(c, "POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": box_ck.get("checkpoint", "box")})
        await w(c, "POST", f"/v1/sandboxes/{sid}/fork", json={"to_users": ["ada-box"]})
        await w(c, "POST", f"/v1/sandboxes/{sid}/sleep", json={})
        await w(c, "POST", f"/v1/sandboxes/{sid}/wake", json={})
        await w(c, "GET", f"/v1/sandboxes/{sid}")
        done = (await w(c, "POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "hi"], "detach": True})).json()
        assert (await _poll(c, f"/v1/executions/{done['id']}", lambda b: b["status"] != "running"))["status"] == "succeeded"
        await w(c, "GET", f"/v1/executions/{done['id']}")
        await w(c, "GET", f"/v1/executions/{done['id']}/output")

        # The agent's app, with the owner's key and through a share link.
        await w(c, "GET", f"{U}/app", follow_redirects=False)
        await w(c, "GET", f"{U}/app/status")
        await w(c, "GET", f"{U}/app/")
        await w(c, "POST", f"{U}/app/items", json={"x": 1})
        link = (await w(c, "POST", f"{U}/share-links", json={"ttl_s": 600, "label": "walk"})).json()
        for _ in range(2):
            await w(c, "POST", f"{U}/share-links", json={"ttl_s": 60}, headers={"idempotency-key": "walk-link"})
        await w(c, "GET", f"{U}/share-links")
        async with aclient(live_rt) as anon:
            await w(anon, "GET", f"/v1/shared/{link['token']}", follow_redirects=False)
            await w(anon, "GET", f"/v1/shared/{link['token']}/status")
            await w(anon, "GET", f"/v1/shared/{link['token']}/")
            await w(anon, "POST", f"/v1/shared/{link['token']}/items", json={"x": 1})
        await w(c, "DELETE", f"{U}/share-links/{link['id']}")

        # Secrets.
        await w(c, "PUT", f"{A}/secrets/API_TOKEN", json={"value": "s3cret"})
        await w(c, "GET", f"{A}/secrets")
        await w(c, "DELETE", f"{A}/secrets/API_TOKEN")
        await w(c, "PUT", f"{U}/secrets/OWN_TOKEN", json={"value": "mine"})
        await w(c, "GET", f"{U}/secrets")
        await w(c, "DELETE", f"{U}/secrets/OWN_TOKEN")

        # Webhooks: one to a port nothing listens on, and a delivery of a turn's interrupt to it.
        hook = (await w(c, "POST", f"{A}/webhooks", json={"url": "http://127.0.0.1:9/hook"})).json()
        for _ in range(2):
            again = (await w(c, "POST", f"{A}/webhooks", json={"url": "http://127.0.0.1:9/again"},
                             headers={"idempotency-key": "walk-hook"})).json()
        await w(c, "DELETE", f"{A}/webhooks/{again['id']}")
        await w(c, "GET", f"{A}/webhooks")
        await w(c, "GET", f"{A}/webhooks/{hook['id']}")
        await w(c, "POST", f"{A}/invoke", json={"message": "approve", "user": "ada"})
        deliveries = (await w(c, "GET", f"{A}/webhooks/{hook['id']}/deliveries")).json()["data"]
        assert deliveries, "an interrupt.waiting delivery"
        await w(c, "GET", f"{A}/webhooks/{hook['id']}/deliveries/{deliveries[0]['id']}")
        await w(c, "POST", f"{A}/webhooks/{hook['id']}/deliveries/{deliveries[0]['id']}/replay")
        await w(c, "DELETE", f"{A}/webhooks/{hook['id']}")

        # Retention.
        await w(c, "GET", "/v1/retention")
        await w(c, "PUT", "/v1/retention", json={"ttl_s": {"session": 86400}})
        await w(c, "GET", f"{A}/retention")
        await w(c, "PUT", f"{A}/retention", json={"ttl_s": 3600})

        # Usage, traces, fleet.
        await w(c, "GET", "/v1/usage")
        await w(c, "GET", "/v1/usage", params={"group": "day", "agent": "walk", "user": "ada"})
        await w(c, "GET", "/v1/traces", params={"limit": 5})
        await w(c, "GET", f"/v1/traces/{turn['trace_id']}")
        await w(c, "GET", "/v1/fleet")

        # Realistic failures answer problems as documented too.
        await w(c, "POST", f"{A}/invoke", expect=502, json={"message": "boom", "user": "ada"})
        await w(c, "PUT", f"{A}/users/capped", json={"limits": {"cost_usd_per_month": 0}})
        await w(c, "POST", f"{A}/invoke", expect=429, json={"message": "hi", "user": "capped"})
        await w(c, "POST", f"/v1/workflows/{waiting['run_id']}/answer", expect=409, json={"answer": "again"})
        await w(c, "GET", "/v1/executions/nope", expect=404)

        # Last: forget a user, then the whole agent.
        await w(c, "DELETE", "/v1/agents/walk/users/ada-copy")
        await w(c, "DELETE", A)

    every = {op["operationId"] for ops in spec["paths"].values() for op in ops.values()}
    assert every - w.walked - set(NOT_WALKED) == set(), "operations the walk does not reach (walk them, or say why not)"
    assert w.mismatches == [], "answers that differ from /openapi.json:\n" + "\n".join(w.mismatches)
