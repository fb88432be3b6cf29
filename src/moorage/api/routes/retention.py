"""Data retention over HTTP: the tenant's TTL per scope kind and record kind (``/v1/retention``) and one agent's
own TTL or zero retention (``/v1/agents/{agent}/retention``). The store applies them (see docs/lifecycle.md)."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.routes._common import agent_of
from moorage.api.routing import Call, Endpoint
from moorage.errors import InvalidInput
from moorage.store import TenantStore
from moorage.store import zero_retention
from moorage.store.repos.retention import RETENTION_KINDS

_TTL = {"type": ["number", "null"], "exclusiveMinimum": 0}


def _agent_json(ts: TenantStore, name: str) -> dict[str, Any]:
    return {"agent": name, "ttl_s": ts.retention.agents().get(name),
            "zero_retention": zero_retention.is_zero(ts.agents.get(name))}


def _tenant_json(ts: TenantStore) -> dict[str, Any]:
    kinds = ts.retention.get()
    own = ts.retention.agents()
    agents = [{"agent": a.name, "ttl_s": own.get(a.name), "zero_retention": zero_retention.is_zero(a)}
              for a in ts.agents.list() if a.name in own or zero_retention.is_zero(a)]
    return {"ttl_s": {k: kinds.get(k) for k in RETENTION_KINDS}, "agents": agents}


def get_agent_retention(call: Call) -> dict[str, Any]:
    return _agent_json(call.tenant, agent_of(call).name)


async def set_agent_retention(call: Call) -> dict[str, Any]:
    agent = await run_in_threadpool(agent_of, call)
    body = call.body if isinstance(call.body, dict) else {}
    unknown = sorted(set(body) - {"ttl_s", "zero_retention"})
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}", hint='send {"ttl_s": <seconds or null>} and/or {"zero_retention": true}')
    if not body:
        raise InvalidInput("missing field 'ttl_s'",
                           hint='send {"ttl_s": <seconds>} ({"ttl_s": null} clears it), or {"zero_retention": true}')
    zero = call.field("zero_retention", bool, required=False)
    ttl = call.field("ttl_s", (int, float), required=False)
    if zero and ttl is not None:
        raise InvalidInput("ttl_s and zero_retention = true together",
                           hint="zero retention keeps nothing after a turn, so a TTL has nothing to expire: send one")
    ts = call.tenant
    if "ttl_s" in body:
        await run_in_threadpool(ts.retention.set_agent, agent.name, ttl)
    if zero is not None:
        await run_in_threadpool(zero_retention.set_zero, ts, agent.name, zero)
        drop = getattr(call.ctx.runtime, "drop_cached_vectors", None)
        if zero and drop is not None:  # what the purge deleted must not linger in this host's search cache
            drop(ts, agent.name)
    return await run_in_threadpool(_agent_json, ts, agent.name)


def get_tenant_retention(call: Call) -> dict[str, Any]:
    return _tenant_json(call.tenant)


async def set_tenant_retention(call: Call) -> dict[str, Any]:
    body = call.body if isinstance(call.body, dict) else {}
    unknown = sorted(set(body) - {"ttl_s"})
    if unknown or not isinstance(body.get("ttl_s"), dict) or not body["ttl_s"]:
        raise InvalidInput("send the TTLs to set by kind", hint='e.g. {"ttl_s": {"session": 86400, "user": null}} '
                                                               f"(kinds: {', '.join(RETENTION_KINDS)}; null keeps forever)")
    ttls: dict[str, Any] = body["ttl_s"]
    for kind, ttl in ttls.items():  # all validated before any is written
        if kind not in RETENTION_KINDS:
            raise InvalidInput(f"unknown retention kind {kind!r}", hint=f"one of {', '.join(RETENTION_KINDS)}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
            raise InvalidInput(f"ttl_s.{kind} must be a positive number of seconds or null, not {ttl!r}")
    ts = call.tenant

    def write() -> None:
        with ts.transaction():
            for kind, ttl in ttls.items():
                ts.retention.set(kind, ttl)

    await run_in_threadpool(write)
    return await run_in_threadpool(_tenant_json, ts)


AGENT_RETENTION = S.obj({"agent": S.STR, "ttl_s": {"type": ["number", "null"]}, "zero_retention": {"type": "boolean"}})
TENANT_RETENTION = S.obj({"ttl_s": S.obj({k: {"type": ["number", "null"]} for k in RETENTION_KINDS}),
                          "agents": {"type": "array", "items": AGENT_RETENTION}})

ENDPOINTS = [
    Endpoint("GET", "/v1/retention", get_tenant_retention,
             "The tenant's data retention: idle seconds before a session, user or workflow is deleted, seconds "
             "before a finished execution or a usage row is, per kind (null: kept), and the agents with a retention "
             "of their own", "retention", "getRetention", scope="read",
             response=TENANT_RETENTION),
    Endpoint("PUT", "/v1/retention", set_tenant_retention,
             "Set or clear the tenant's TTL of one or more kinds (an agent's shorter TTL still wins for its scopes; "
             "usage: at least 31 days)",
             "retention", "setRetention", scope="admin",
             body=S.obj({"ttl_s": S.obj({k: _TTL for k in RETENTION_KINDS}, [])}, ["ttl_s"]), response=TENANT_RETENTION),
    Endpoint("GET", "/v1/agents/{agent}/retention", get_agent_retention,
             "An agent's own data retention (ttl_s: idle seconds before its sessions, users and runs are deleted; "
             "zero_retention: nothing of a turn is kept once it ends)", "retention", "getAgentRetention", scope="read",
             response=AGENT_RETENTION),
    Endpoint("PUT", "/v1/agents/{agent}/retention", set_agent_retention,
             "Set or clear an agent's own TTL (the shorter of it and the tenant's per-kind TTL wins), or turn its "
             "zero retention on or off", "retention", "setAgentRetention", scope="deploy",
             body=S.obj({"ttl_s": _TTL, "zero_retention": {"type": "boolean"}}, []), response=AGENT_RETENTION),
]
