"""End-users of an agent as a resource: put (idempotent get-or-create, optionally provisioned now), get, list
(paginated, filtered by metadata), delete (forget everything about the user).

The product names its users by its own ids; instances are forked on the first turn, or at once with
``?provision=true`` (forked, then put to sleep so the first turn only wakes it).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.pagination import decode_cursor, encode_cursor, parse_limit
from moorage.api.routes._common import CURSOR, LIMIT, agent_of, bool_query, forward_if_awake_elsewhere, releaser
from moorage.api.routing import Call, Endpoint, Param, Reply
from moorage.errors import InvalidInput
from moorage.fleet.forward import LET_GO, forwarded
from moorage.lifecycle.config import AgentLifecycle
from moorage.store import EntityKey, TenantStore
from moorage.store.agent_users import USER_LIMITS, AgentUser
from moorage.store.model import Agent, check_id

META_PREFIX = "metadata."


def user_json(u: AgentUser, ts: TenantStore) -> dict[str, Any]:
    return users_json([u], ts, ts.agents.get(u.agent))[0]


def users_json(users: list[AgentUser], ts: TenantStore, agent: Agent) -> list[dict[str, Any]]:
    """Users of ``agent`` with their instances: one read of the instances for the whole page (a read per user made
    a page of 200 cost 400 queries)."""
    recs = {}
    if users and AgentLifecycle.of(agent).scope == "user":
        recs = ts.sandboxes.for_scopes([EntityKey(u.agent, u.user).scope("user") for u in users])
    out = []
    for u in users:
        rec = recs.get(EntityKey(u.agent, u.user).scope("user").key)
        instance = None if rec is None else {"sandbox_id": rec.id, "state": rec.state, "last_active": rec.last_active}
        out.append({"agent": u.agent, "id": u.user, "metadata": u.meta, "limits": u.limits,
                    "created_at": u.created_at, "updated_at": u.updated_at, "instance": instance})
    return out


async def _provision(call: Call, agent_name: str, user: str) -> None:
    """Fork the user's instance from the live template now, then sleep it: the first turn only wakes it."""
    runtime = call.runtime
    ts = call.tenant
    agent = await run_in_threadpool(ts.agents.get, agent_name)
    lc = AgentLifecycle.of(agent)
    if lc.scope != "user":
        raise InvalidInput(f"agent {agent_name!r} has one instance per {lc.scope}, not per user: nothing to provision ahead",
                           hint="omit ?provision=true; instances start on the first turn")
    scope = EntityKey(agent_name, user).scope("user")

    async def template() -> Any:
        return await runtime._template_for(ts, agent)

    await runtime.instances.ensure_running(ts, scope, template, lifecycle=lc)
    await runtime.instances.sleep(ts, scope, reason="provisioned")


async def put_user(call: Call) -> Reply:
    agent = await run_in_threadpool(agent_of, call)
    user = check_id(call.path["user"], "user id")
    meta = call.field("metadata", dict, required=False)
    limits = call.field("limits", dict, required=False)
    provision = bool_query(call, "provision")
    if provision:
        # In the instance's line like a turn, the registration with it: a forget of the user sent at the same time
        # (which holds the line) runs wholly before or after, never between them (it left a sandbox of a user
        # it had just deleted, or deleted the sandbox as it was provisioned: a 404).
        async with call.runtime._in_line(call.tenant, EntityKey(agent.name, user).scope("user")):
            u, created = await run_in_threadpool(call.tenant.agent_users.put, agent.name, user, meta=meta,
                                                 limits=limits)
            await _provision(call, agent.name, user)
    else:
        u, created = await run_in_threadpool(call.tenant.agent_users.put, agent.name, user, meta=meta, limits=limits)
    body = await run_in_threadpool(user_json, u, call.tenant)
    return Reply(body, 201 if created else 200,
                 {"Location": f"/v1/agents/{agent.name}/users/{user}"} if created else {})


def get_user(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    return user_json(call.tenant.agent_users.get(agent.name, check_id(call.path["user"], "user id")), call.tenant)


def list_users(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    limit = parse_limit(call.query("limit"))
    after = decode_cursor(call.query("cursor")).get("after")
    if after is not None and not isinstance(after, str):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    meta = {k[len(META_PREFIX):]: v for k, v in call.request.query_params.items() if k.startswith(META_PREFIX)}
    users = call.tenant.agent_users.list(agent.name, limit=limit + 1, after=after, meta=meta or None)
    page = users[:limit]
    return {"data": users_json(page, call.tenant, agent),
            "next_cursor": encode_cursor({"after": page[-1].user}) if len(users) > limit else None}


async def _forward_to_holder(call: Call, agent: str, user: str) -> None:
    """In a fleet, a forget of a user one of whose instances another live host holds awake goes to that host
    (``Misplaced``: forwarded), before this host changes anything: that host cancels the turns it runs and destroys
    the sandbox itself, and takes the user's other (sleeping) instances as this host would (docs/fleet.md)."""
    if getattr(getattr(call.runtime, "instances", None), "fleet", None) is None:
        return
    recs = await run_in_threadpool(call.tenant.sandboxes.list, agent_id=agent, limit=100_000)
    for rec in recs:
        if rec.scope.user == user:
            await forward_if_awake_elsewhere(call, rec)


async def delete_user(call: Call) -> dict[str, Any]:
    agent = await run_in_threadpool(agent_of, call)
    user = check_id(call.path["user"], "user id")
    if forwarded.get() and call.request.headers.get(LET_GO):
        # Another host serves this forget and asks this one to let go of the user's instances it holds awake
        # (``forwarded`` holds only for a request that host signed, LET_GO included: a caller's own is a forget).
        await call.runtime.let_go(call.who, agent.name, user)
        return {"agent": agent.name, "user": user, "removed": 0, "deleted": False}
    if not forwarded.get():  # one hop: a forwarded forget is served here, whoever holds the user's instances
        await _forward_to_holder(call, agent.name, user)
    erase_in_runtime = getattr(call.ctx.runtime, "erase", None)
    if erase_in_runtime is not None:  # the runtime also drops the user's sandboxes and snapshots (and the user)
        release = releaser(call)
        removed, deleted = await erase_in_runtime(call.who, agent.name, user,
                                                  **({"release": release} if release is not None else {}))
    else:
        removed = await run_in_threadpool(call.tenant.forget_user, user, agent.name)
        deleted = await run_in_threadpool(call.tenant.agent_users.delete, agent.name, user)
    return {"agent": agent.name, "user": user, "removed": removed if isinstance(removed, int) else 0,
            "deleted": deleted}


_USER = "/v1/agents/{agent}/users/{user}"
_LIMITS = S.obj({k: {"type": ["number", "null"], "minimum": 0} for k in USER_LIMITS}, [])
USER_SCHEMA = S.obj({"agent": S.STR, "id": S.STR, "metadata": S.OBJ, "limits": S.OBJ, "created_at": S.NUM,
                     "updated_at": S.NUM,
                     # The user's instance, once it exists (agents with one instance per user).
                     "instance": {"type": ["object", "null"], "properties": {"sandbox_id": S.STR, "state": S.STR,
                                                                            "last_active": S.NUM},
                                  "required": ["sandbox_id", "state", "last_active"]}})

ENDPOINTS = [
    Endpoint("PUT", _USER, put_user, "Get or create an end-user of the agent by the product's own id (idempotent)",
             "users", "putUser", scope="provision", status=200, idempotency="none",
             query=(Param("provision", {"type": "boolean"}, "fork the user's instance now and put it to sleep"),),
             body=S.obj({"metadata": S.OBJ, "limits": _LIMITS}, []), response=USER_SCHEMA,
             other_responses=((201, USER_SCHEMA),)),
    Endpoint("GET", _USER, get_user, "Get an end-user of the agent", "users", "getUser", scope="read",
             also_scopes=("provision",), response=USER_SCHEMA),
    Endpoint("GET", "/v1/agents/{agent}/users", list_users, "List the agent's end-users (filter: ?metadata.KEY=VALUE)",
             "users", "listUsers", scope="read", also_scopes=("provision",), query=(LIMIT, CURSOR),
             response={"type": "object", "properties": {"data": {"type": "array", "items": USER_SCHEMA},
                                                        "next_cursor": S.NSTR}}),
    Endpoint("DELETE", _USER, delete_user, "Delete an end-user: forget everything stored about them for this agent",
             "users", "forgetUser", scope="provision", response=S.ref("Forgotten")),
]
