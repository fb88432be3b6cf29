"""Pieces shared by route modules: standard query parameters and lookups that 404 outside the tenant.

Lookups go through the tenant's store handle, so another tenant's ids are simply not found.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from moorage.api.routing import Call, Param
from moorage.errors import InvalidInput, NotFound, TenantScopeError, UnavailableError
from moorage.fleet.forward import LET_GO
from moorage.store import Agent
from moorage.store.model import check_id
from moorage.store.repos.agents import refuse_if_deleting

LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}, "page size")
CURSOR = Param("cursor", {"type": "string"}, "next_cursor of the previous page")
PAGE = (LIMIT, CURSOR)


def agent_of_key(call: Call, what: str) -> str | None:
    """The ``?agent=`` of a listing that spans agents. A key limited to one agent must name its own: the answer
    is then that agent's only, and never a silent filter (a 403 whose hint says what to add)."""
    agent, limited = call.query("agent"), call.who.agent
    if limited is not None and agent != limited:
        raise TenantScopeError(f"this key is limited to agent {limited!r}; it may read that agent's {what} only",
                               hint=f"add agent={limited} to the query, or use a key that is not limited to one agent")
    return agent


def agent_of(call: Call) -> Agent:
    """The path's agent in the caller's tenant (404 if it is not there; 409 for a request that would add to an
    agent being deleted: only reads and deletes are served then)."""
    agent = call.tenant.agents.get(check_id(call.path["agent"], "agent name"))
    return agent if call.request.method in ("GET", "HEAD", "DELETE") else refuse_if_deleting(agent)


def known_user(call: Call, agent: str, user: str) -> None:
    """404 unless ``user`` is one of ``agent``'s end-users in the caller's tenant: registered (PUT, a turn, a fork),
    or with a session or an instance of the agent. For a listing that names a user: a mistyped id is an error, not
    an empty list (a user who has nothing yet still gets one). An end-user token's own user counts as known: the
    product issued it for them, and they may not have talked to the agent yet."""
    if call.who.user is not None:
        return
    if not call.tenant.knows_user(agent, user):
        raise NotFound(f"agent {agent!r} has no user {user!r}",
                       hint=f"check the user id; GET /v1/agents/{agent}/users lists them")


async def forward_if_awake_elsewhere(call: Call, rec: Any) -> None:
    """Raise ``Misplaced`` (the request is forwarded, docs/fleet.md) when ``rec``'s instance is held by another
    live host of the fleet: for work started in the background here, which would otherwise find it elsewhere."""
    fleet = getattr(getattr(call.runtime, "instances", None), "fleet", None)
    if fleet is None or rec is None or rec.host in (None, fleet.host_id):
        return
    from moorage.lifecycle import fleet as fleet_rules
    from moorage.lifecycle.manager import Misplaced

    if await run_in_threadpool(fleet_rules.placement, fleet, rec) == "forward":
        raise Misplaced(rec)


def float_query(call: Call, name: str) -> float | None:
    raw = call.query(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError as e:
        raise InvalidInput(f"{name} must be a number (seconds since the epoch), got {raw!r}") from e
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidInput(f"{name} must be a finite number")
    return value


def bool_query(call: Call, name: str) -> bool:
    raw = (call.query(name) or "").lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise InvalidInput(f"{name} must be true or false, got {raw!r}")


def releaser(call: Call) -> Callable[[Any], Awaitable[None]] | None:
    """In a fleet, how this host asks another live host to let go of an instance it holds awake, for the forget
    this host serves (of a user, or of a whole agent: lifecycle/forget.py): the same request, the caller's
    credentials, ``LET_GO``."""
    fleet = getattr(getattr(call.runtime, "instances", None), "fleet", None)
    if fleet is None:
        return None

    async def release(rec: Any) -> None:
        owner = await run_in_threadpool(fleet.host, rec.host)
        if owner is None:
            raise UnavailableError(f"host {rec.host!r}, which holds an instance to forget, is not in the fleet",
                                   hint="retry the forget")
        r = await fleet.forwarder.ask(call.request, owner.id, owner.url, {LET_GO: "1"}, call.trace_id)
        if r.status_code != 200:
            raise UnavailableError(f"host {owner.id!r} did not let go of the instance it holds "
                                   f"(HTTP {r.status_code}: {r.text[:200]})", hint="retry the forget")

    return release
