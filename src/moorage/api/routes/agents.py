"""Agents and their deployments: list, get, delete an agent (runtime/agent_delete.py); deploy a tar.gz, roll back,
delete a deployment; end-user tokens (retention: retention.py).

Deploy and rollback go to the runtime; listing reads the tenant's store. A deploy answers when its template is
built (201), or streams the build's progress (``Accept: text/event-stream`` / ``?stream=true``).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.detached import detached
from moorage.api.pagination import offset_page, parse_limit
from moorage.api.routes._common import PAGE, agent_of, releaser
from moorage.api.routing import Call, Endpoint, Param, Reply
from moorage.errors import InvalidInput, NotFound
from moorage.fleet.forward import LET_GO, forwarded
from moorage.lifecycle.config import AgentLifecycle
from moorage.store.model import check_id

#: Agent packages are source trees, not images: 64 MiB is generous and bounds memory per request.
DEPLOY_BODY_LIMIT = 64 << 20


def list_agents(call: Call) -> dict[str, Any]:
    agents = call.tenant.agents.list()
    return offset_page(lambda n: agents[:n], parse_limit(call.query("limit")), call.query("cursor"), S.agent)


def get_agent(call: Call) -> dict[str, Any]:
    return S.agent(agent_of(call))


def list_deployments(call: Call) -> dict[str, Any]:
    deps = call.tenant.deployments.list(agent_of(call).id)
    if call.ctx.runtime is not None:  # a deploy whose builder died (in a fleet, on another host) reads failed
        deps = call.runtime.settle_builds(call.tenant, deps)
    return offset_page(lambda n: deps[:n], parse_limit(call.query("limit")), call.query("cursor"), S.deployment)


async def deploy(call: Call) -> Reply:
    name = check_id(call.path["agent"], "agent name")
    if not isinstance(call.body, bytes) or not call.body:
        raise InvalidInput("empty deployment", hint="upload the agent directory as a tar.gz body")
    if call.body[:2] != b"\x1f\x8b":
        raise InvalidInput("the deployment is not a gzip archive", hint="upload `tar czf - -C my-agent .` as the body")
    runtime = call.runtime
    from moorage.runtime.package import load_archive

    pkg = await run_in_threadpool(load_archive, call.body)
    if pkg.name != name:
        raise InvalidInput(f"the package is agent {pkg.name!r}, not {name!r}",
                           hint=f"deploy it to /v1/agents/{pkg.name}/deployments or fix [agent] name in moorage.toml")
    return await detached(call, f"deploy-{name}",
                          lambda progress: runtime.deploy(call.who, call.body, on_progress=progress),
                          "deployment", S.deployment, 201)


async def rollback(call: Call) -> dict[str, Any]:
    number = call.field("number", int, required=False)
    if number is not None and number < 1:
        raise InvalidInput("number must be a deployment number (1 or more)", hint="omit it to go back one deployment")
    agent = await run_in_threadpool(agent_of, call)
    return S.deployment(await call.runtime.rollback(call.who, agent.name, number))


async def delete_deployment(call: Call) -> dict[str, Any]:
    raw = call.path["number"]
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1 or len(raw) > 18:
        raise InvalidInput(f"{raw[:40]!r} is not a deployment number (1 or more)",
                           hint=f"GET /v1/agents/{call.path['agent']}/deployments lists them with their numbers")
    agent = await run_in_threadpool(agent_of, call)
    return S.deployment(await call.runtime.delete_deployment(call.who, agent.name, int(raw)))


async def delete_agent(call: Call) -> Reply:
    name = check_id(call.path["agent"], "agent name")
    if forwarded.get() and call.request.headers.get(LET_GO):
        # Another host serves this delete and asks this one to let go of the agent's instances it holds awake
        # (``forwarded`` holds only for a request that host signed, LET_GO included: a caller's own is a delete).
        await call.runtime.let_go_agent(call.who, name)
        return Reply({"agent": name, "deleted": False, "users": 0, "removed": 0}, 200)
    await run_in_threadpool(call.tenant.agents.get, name)  # 404 before anything starts
    release = releaser(call)
    return await detached(call, f"delete-agent-{name}",
                          lambda progress: call.runtime.delete_agent(call.who, name, on_progress=progress,
                                                                     **({"release": release} if release else {})),
                          "deleted", dict, 200)


def issue_token(call: Call) -> Reply:
    agent = agent_of(call)
    user = check_id(call.path["user"], "user id")
    ttl = call.field("ttl_s", (int, float), required=False)

    def user_record() -> float | None:
        # The token dies with this user's record (a forget). An agent that makes users as they come makes this one
        # now, as the token's first turn would: a token tied to no record would register a forgotten user again.
        # One that serves only users it was given refuses a token for a user it does not have: such a token was
        # tied to no record, so it outlived a forget of the user the product created after it.
        rec = call.tenant.agent_users.find(agent.name, user)
        if rec is None:
            if AgentLifecycle.of(agent).users != "auto" and not call.tenant.knows_user(agent.name, user):
                raise NotFound(f"agent {agent.name!r} has no user {user!r}",
                               hint=f"create the user first (PUT /v1/agents/{agent.name}/users/{user}), then issue "
                                    f"the token; this agent has users = \"existing\"")
            rec, _ = call.tenant.agent_users.put(agent.name, user)  # auto, or one with data from before
        return rec.created_at

    tok = call.ctx.auth.issue_user_token(call.who, agent.name, user, ttl, user_record=user_record)
    return Reply({"token": tok.token, "agent": tok.agent, "user": tok.user, "expires_at": tok.expires_at}, 201)


ENDPOINTS = [
    Endpoint("GET", "/v1/agents", list_agents, "List agents", "agents", "listAgents", scope="read", query=PAGE,
             response=S.page_of("Agent")),
    Endpoint("GET", "/v1/agents/{agent}", get_agent, "Get an agent", "agents", "getAgent", scope="read", response=S.ref("Agent")),
    Endpoint("DELETE", "/v1/agents/{agent}", delete_agent,
             "Delete an agent: forget every end-user of it and everything it kept, its deployments, and the agent",
             "agents", "deleteAgent", scope="deploy", response=S.ref("AgentDeleted"), streams=True,
             query=(Param("stream", {"type": "boolean"},
                          "answer with server-sent events: `progress` ({message}) as users are forgotten, then "
                          "`deleted` (or `error`)"),)),
    Endpoint("GET", "/v1/agents/{agent}/deployments", list_deployments, "List an agent's deployments", "agents",
             "listDeployments", scope="read", query=PAGE, response=S.page_of("Deployment")),
    Endpoint("POST", "/v1/agents/{agent}/deployments", deploy, "Deploy an agent directory (tar.gz body)", "agents",
             "deployAgent", scope="deploy", status=201, body={"type": "string", "format": "binary"},
             body_type="application/gzip", max_body=DEPLOY_BODY_LIMIT, response=S.ref("Deployment"), streams=True,
             query=(Param("stream", {"type": "boolean"},
                          "answer with server-sent events: `progress` ({message}) as the build goes, then "
                          "`deployment` (or `error`)"),)),
    Endpoint("DELETE", "/v1/agents/{agent}/deployments/{number}", delete_deployment,
             "Delete a deployment that is neither live nor building (its package stops counting for the tenant)",
             "agents", "deleteDeployment", scope="deploy", response=S.ref("Deployment")),
    Endpoint("POST", "/v1/agents/{agent}/rollback", rollback, "Make an earlier deployment live again", "agents",
             "rollbackAgent", scope="deploy", body=S.obj({"number": {"type": "integer", "minimum": 1}}, []),
             response=S.ref("Deployment")),
    Endpoint("POST", "/v1/agents/{agent}/users/{user}/tokens", issue_token,
             "Issue an end-user token limited to one user of this agent", "agents", "issueUserToken",
             scope="deploy", status=201, secret_fields=("token",), body=S.obj({"ttl_s": {"type": "number", "exclusiveMinimum": 0}}, []),
             response=S.ref("UserToken")),
]
