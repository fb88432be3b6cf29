"""The JSON shapes of the API: how store records are rendered, and the JSON Schemas that describe them.

Renderers and schemas sit side by side so the served OpenAPI document cannot drift from the output.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from moorage.store import Agent, ApiKey, Deployment, Event, Fact, SandboxRecord, Session, Span, Step, WorkflowRun

ID = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$"}
STR = {"type": "string"}
NSTR = {"type": ["string", "null"]}
NUM = {"type": "number"}
NNUM = {"type": ["number", "null"]}
INT = {"type": "integer"}
OBJ = {"type": "object"}
ANY: dict[str, Any] = {}


def obj(props: dict[str, Any], required: list[str] | None = None, extra: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, "required": required if required is not None else list(props)}
    if not extra:
        out["additionalProperties"] = False
    return out


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def page_of(name: str) -> dict[str, Any]:
    return obj({"data": {"type": "array", "items": ref(name)}, "next_cursor": NSTR})


COMPONENTS: dict[str, dict[str, Any]] = {
    # retry_after: with a 429 or 503, the seconds to wait (the Retry-After header rounds them up);
    # current_version: with a 409 over a stale version, the version the resource has now;
    # error: on the OpenAI-compatible routes, OpenAI's error object, read by the official openai clients.
    "Problem": obj({"type": STR, "title": STR, "status": INT, "detail": STR, "hint": NSTR, "trace_id": NSTR,
                    "retry_after": NUM, "current_version": INT,
                    "error": obj({"message": STR, "type": STR, "code": STR, "param": {"type": "null"}})},
                   ["type", "title", "status", "detail"]),
    # limits and deleting_since: in the operator's listing (GET /v1/tenants), not in what POST /v1/tenants answers.
    "Tenant": obj({"id": STR, "name": STR, "created_at": NUM, "limits": obj({"storage_mib": NUM}, required=[]),
                   "deleting_since": NNUM}, required=["id", "name", "created_at"]),
    # agent: the one agent a key is limited to (null: every agent of the tenant).
    "ApiKey": obj({"id": STR, "scopes": {"type": "array", "items": STR}, "label": STR, "agent": NSTR,
                   "created_at": NUM, "revoked_at": NNUM, "secret": NSTR},
                  ["id", "scopes", "label", "agent", "created_at", "revoked_at"]),
    "Agent": obj({"id": STR, "name": STR, "config": OBJ, "live_deployment": NSTR, "created_at": NUM,
                  "updated_at": NUM, "version": INT}),
    "Deployment": obj({"id": STR, "agent_id": STR, "number": INT, "manifest": OBJ, "package_sha256": STR,
                       "status": STR, "created_at": NUM}),
    # token: shown once; null in the replay of a request asked again with its Idempotency-Key.
    "UserToken": obj({"token": NSTR, "agent": STR, "user": STR, "expires_at": NUM}),
    "Session": obj({"id": STR, "agent": STR, "user": STR, "created_at": NUM, "last_active": NUM, "meta": OBJ}),
    "Event": obj({"id": INT, "scope": STR, "ts": NUM, "kind": STR, "speaker": NSTR, "content": STR, "meta": OBJ}),
    # A search hit, as ctx.memory.recall returns it too: the event's fields (text: its content), score, the event.
    "Recall": obj({"id": INT, "text": STR, "speaker": NSTR, "ts": NUM, "kind": STR, "scope": STR, "meta": OBJ,
                   "score": NUM, "event": ref("Event")}),
    "Fact": obj({"id": STR, "scope": STR, "subject": STR, "attribute": STR, "value": STR, "text": STR,
                 "valid_from": NUM, "valid_to": NNUM, "recorded_at": NUM, "superseded_at": NNUM,
                 "superseded_by": NSTR, "trust": STR, "status": STR, "source": STR, "version": INT,
                 "confirmed_at": NNUM}),
    "FactChange": obj({"action": STR, "fact": ref("Fact"), "previous": {"oneOf": [ref("Fact"), {"type": "null"}]}}),
    "WorkflowRun": obj({"id": STR, "scope": STR, "name": STR, "status": STR, "input": ANY, "state": OBJ,
                        "current_step": NSTR, "result": ANY, "error": NSTR, "created_at": NUM, "updated_at": NUM,
                        "version": INT}),
    "Step": obj({"seq": INT, "name": STR, "status": STR, "attempts": INT, "result": ANY, "error": NSTR,
                 "started_at": NUM, "finished_at": NNUM}),
    "WorkflowDetail": obj({"run": ref("WorkflowRun"), "steps": {"type": "array", "items": ref("Step")},
                           "history": {"type": "array", "items": obj({"key": STR, "step": NSTR, "status": STR,
                                                                      "result": ANY, "error": NSTR,
                                                                      "created_at": NUM, "updated_at": NUM})}}),
    "Sandbox": obj({"id": STR, "agent_id": STR, "scope": STR, "state": STR, "last_active": NUM, "ttl_s": NNUM,
                    "created_at": NUM, "version": INT, "wake_kind": NSTR,
                    "resumed_from": {"oneOf": [obj({"from": STR, "at": NNUM, "fallback": {"type": "boolean"}}),
                                               {"type": "null"}]}}),
    "Span": obj({"trace_id": STR, "span_id": STR, "parent_id": NSTR, "name": STR, "start_ts": NUM, "end_ts": NNUM,
                 "status": STR, "attrs": OBJ, "scope": NSTR}),
    "Trace": obj({"trace_id": STR, "spans": {"type": "array", "items": ref("Span")}}),
    # days: with ?group=day only, the totals of each UTC day that had usage, oldest first.
    "Usage": obj({"since": NUM, "until": NNUM, "totals": {"type": "object", "additionalProperties": NUM}, "cost_usd": NUM,
                  "days": {"type": "array", "items": obj({"day": {"type": "string", "format": "date"},
                                                          "totals": {"type": "object", "additionalProperties": NUM}})},
                  # With agent and user: each of the user's caps, counted as the check before a turn counts them
                  # (store_mib: a level measured now, with no reset).
                  "caps": {"type": "object", "additionalProperties": obj({"limit": NUM, "used": NUM, "resets_at": NNUM},
                                                                         ["limit", "used", "resets_at"])},
                  # The whole tenant's (no agent, no user), under its storage ceiling (the operator's
                  # tenant_max_storage_mib or its own): MiB kept of it, the measure's parts in bytes
                  # (usage/tenant_cap.py).
                  "storage": obj({"limit": NUM, "used": NUM, "store_bytes": INT, "instance_bytes": INT,
                                  "package_bytes": INT},
                                 ["limit", "used", "store_bytes", "instance_bytes", "package_bytes"])},
                 ["since", "totals", "cost_usd"]),
    # An agent's handler may return text or any JSON value (a dict, a list); null while the turn waits.
    "TurnResult": obj({"turn_id": STR, "status": {"enum": ["done", "waiting"]},
                       "reply": {"description": "the agent's answer: text or any JSON value; null while waiting"},
                       "interrupt": ANY, "trace_id": NSTR, "run_id": NSTR, "usage": OBJ}),
    "Forgotten": obj({"agent": STR, "user": STR, "removed": INT, "deleted": {"type": "boolean"}}),
    "AgentDeleted": obj({"agent": STR, "deleted": {"type": "boolean"}, "users": INT, "removed": INT}),
    "TenantDeleted": obj({"tenant": obj({"id": STR, "name": STR}), "deleted": {"type": "boolean"}, "agents": INT,
                          "users": INT, "removed": INT, "keys_revoked": INT}),
    # A JSON-RPC 2.0 message to the MCP server (docs/mcp.md): a request (with an id) or a notification (without;
    # answered 202 with no body), or a batch of them. ``method`` is an MCP method: initialize, tools/list,
    # tools/call, notifications/initialized, ...
    "McpRequest": {"oneOf": [{"$ref": "#/components/schemas/McpMessage"},
                             {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/McpMessage"}}]},
    "McpMessage": obj({"jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer"]}, "method": STR,
                       "params": OBJ}, ["jsonrpc", "method"]),
    # A JSON-RPC 2.0 response of the MCP server (docs/mcp.md): a result, or an error, for the request's id.
    "McpResponse": obj({"jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer", "null"]}, "result": OBJ,
                        "error": obj({"code": INT, "message": STR, "data": ANY}, ["code", "message"])}, ["jsonrpc", "id"]),
}


# -- renderers --------------------------------------------------------------------------------


def key(k: ApiKey) -> dict[str, Any]:
    return {"id": k.id, "scopes": sorted(k.scopes), "label": k.label, "agent": k.agent, "created_at": k.created_at,
            "revoked_at": k.revoked_at, "secret": k.secret}


def agent(a: Agent) -> dict[str, Any]:
    return asdict(a)


def deployment(d: Deployment) -> dict[str, Any]:
    # package_ref is a host path: internal, not shown.
    return {"id": d.id, "agent_id": d.agent_id, "number": d.number, "manifest": d.manifest,
            "package_sha256": d.package_sha256, "status": d.status, "created_at": d.created_at}


def session(s: Session) -> dict[str, Any]:
    return {"id": s.id, "agent": s.agent_id, "user": s.user_id, "created_at": s.created_at,
            "last_active": s.last_active, "meta": s.meta}


def event(e: Event) -> dict[str, Any]:
    return {"id": e.id, "scope": e.scope.key, "ts": e.ts, "kind": e.kind, "speaker": e.speaker,
            "content": e.content, "meta": e.meta}


def fact(f: Fact) -> dict[str, Any]:
    return {"id": f.id, "scope": f.scope.key, "subject": f.subject, "attribute": f.attribute, "value": f.value,
            "text": f.text, "valid_from": f.valid_from, "valid_to": f.valid_to, "recorded_at": f.recorded_at,
            "superseded_at": f.superseded_at, "superseded_by": f.superseded_by, "trust": f.trust,
            "status": f.status, "source": f.source, "version": f.version, "confirmed_at": f.confirmed_at}


def run(r: WorkflowRun) -> dict[str, Any]:
    return {"id": r.id, "scope": r.scope.key, "name": r.name, "status": r.status, "input": r.input,
            "state": r.state, "current_step": r.current_step, "result": r.result, "error": r.error,
            "created_at": r.created_at, "updated_at": r.updated_at, "version": r.version}


def step(s: Step) -> dict[str, Any]:
    return {"seq": s.seq, "name": s.name, "status": s.status, "attempts": s.attempts, "result": s.result,
            "error": s.error, "started_at": s.started_at, "finished_at": s.finished_at}


def sandbox(s: SandboxRecord) -> dict[str, Any]:
    # Host, snapshot and disk refs are placement internals of the installation, not tenant-facing.
    return {"id": s.id, "agent_id": s.agent_id, "scope": s.scope.key, "state": s.state, "last_active": s.last_active,
            "ttl_s": s.ttl_s, "created_at": s.created_at, "version": s.version,
            # How its sandbox last came up: fork, snapshot, cold (no memory snapshot) or cold-fallback.
            "wake_kind": s.meta.get("wake_kind"),
            # Fleet: which copy its last wake started from (this host's disk, or a shipped snapshot of when).
            "resumed_from": _resumed(s.meta.get("resumed_from"))}


def _resumed(r: Any) -> dict[str, Any] | None:
    if not isinstance(r, dict):
        return None
    return {"from": str(r.get("from")), "at": r.get("at"), "fallback": bool(r.get("fallback", False))}


def span(s: Span) -> dict[str, Any]:
    return {"trace_id": s.trace_id, "span_id": s.span_id, "parent_id": s.parent_id, "name": s.name,
            "start_ts": s.start_ts, "end_ts": s.end_ts, "status": s.status, "attrs": s.attrs,
            "scope": s.scope.key if s.scope else None}


def turn(result: Any) -> dict[str, Any]:
    """A runtime ``TurnResult`` as JSON."""
    return {"turn_id": str(result.turn_id), "status": result.status, "reply": result.reply,
            "interrupt": result.interrupt, "trace_id": result.trace_id, "run_id": getattr(result, "run_id", None),
            "usage": dict(getattr(result, "usage", None) or {})}
