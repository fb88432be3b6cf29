"""An agent's memory of its users: sessions, the episodic log (list, search), facts (list, as-of, edit; the pending
ones listed, confirmed or rejected).

Every read names one agent and one user (and optionally a session) of the caller's tenant.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.pagination import MAX_LIMIT, decode_cursor, encode_cursor, offset_page, parse_limit
from moorage.api.routes._common import PAGE, agent_of, bool_query, float_query, known_user
from moorage.api.routing import Call, Endpoint, Param, Reply
from moorage.errors import InvalidInput, NotFound
from moorage.store import Scope
from moorage.store.model import check_id
from moorage.usage import tenant_cap

SESSION = Param("session", S.ID, "a session id: read that session's scope instead of the user's")


def _scope(call: Call) -> Scope:
    agent = agent_of(call)
    user = check_id(call.path["user"], "user id")
    session = call.query("session")
    return Scope.session(agent.name, user, session) if session else Scope.for_user(agent.name, user)


def list_sessions(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    user = call.who.user or call.query("user")  # an end-user token only ever sees its own sessions
    if user is not None:
        check_id(user, "user id")
    limit = parse_limit(call.query("limit"))
    cursor = decode_cursor(call.query("cursor"))
    before, offset = cursor.get("before"), cursor.get("o")
    if before is not None and not (isinstance(before, list) and len(before) == 3
                                   and isinstance(before[0], (int, float)) and all(isinstance(v, str) for v in before[1:])):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    if offset is not None and (not isinstance(offset, int) or offset < 0):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    if offset is not None:  # an offset cursor given out before keyed paging: that page, then keyed cursors
        sessions = call.tenant.sessions.page(agent.name, user, limit=offset + limit + 1)[offset:]
    else:
        # Keyed on the last session's (last_active, user, id), not an offset: every session is reachable (an
        # offset listing stopped at 10,000), and a session active again meanwhile is not listed twice.
        sessions = call.tenant.sessions.page(agent.name, user, limit=limit + 1,
                                             before=(float(before[0]), before[1], before[2]) if before else None)
    page, more = sessions[:limit], len(sessions) > limit
    last = page[-1] if page else None
    return {"data": [S.session(x) for x in page],
            "next_cursor": encode_cursor({"before": [last.last_active, last.user_id, last.id]}) if more and last else None}


def list_events(call: Call) -> dict[str, Any]:
    scope = _scope(call)
    limit = parse_limit(call.query("limit"))
    order = call.query("order") or "oldest"
    if order not in ("oldest", "newest"):
        raise InvalidInput(f"order must be oldest or newest, got {order!r}",
                           hint="newest reads the log back from its end, page by page")
    kind = call.query("kind")
    # The log's ids grow with insertion, so "after (or before) this id" is a stable cursor under concurrent appends.
    mark = "after" if order == "oldest" else "before"
    cursor = decode_cursor(call.query("cursor"))
    at = cursor.get(mark, 0 if order == "oldest" else None)
    if (at is not None and not isinstance(at, int)) or set(cursor) - {mark}:
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged, with the same order")
    events = call.tenant.events.list(scope, limit=limit + 1, kinds=[kind] if kind else None,
                                     **({"after_seq": at} if order == "oldest" else {"before_seq": at, "newest_first": True}))
    if not events:  # none: for a user the agent has, not for a mistyped id
        known_user(call, scope.agent, scope.user)
    events.sort(key=lambda e: e.id, reverse=order == "newest")
    page = events[:limit]
    more = len(events) > limit
    return {"data": [S.event(e) for e in page], "next_cursor": encode_cursor({mark: page[-1].id}) if more else None}


def search_events(call: Call) -> dict[str, Any]:
    from moorage.memory import EpisodicMemory

    scope = _scope(call)
    query = call.query("q") or ""
    if not query.strip():
        raise InvalidInput("missing query", hint="pass ?q=what to recall")
    raw_k = call.query("k") or "10"
    try:
        k = parse_limit(raw_k)
    except InvalidInput:  # its message names "limit", a parameter this route does not have
        raise InvalidInput(f"k must be a whole number from 1 to {MAX_LIMIT}, got {raw_k!r}",
                           hint="k is how many results to return") from None
    memory = getattr(call.ctx.runtime, "memory", None)
    # The runtime's memory of the tenant keeps each scope's vectors and index warm between searches (turns'
    # recall uses it too); a new one per request rebuilt them on every search.
    episodic = memory(call.tenant).episodic if memory is not None else EpisodicMemory(call.tenant, call.ctx.embedder())
    hits = episodic.search(scope, query, k=k)
    if not hits:  # nothing recalled: for a user the agent has, not for a mistyped id
        known_user(call, scope.agent, scope.user)
    return {"data": [h.as_json() for h in hits], "next_cursor": None}  # the shape ctx.memory.recall returns


def list_facts(call: Call) -> dict[str, Any]:
    scope = _scope(call)
    subject, attribute = call.query("subject"), call.query("attribute")
    valid_at, known_at = float_query(call, "as_of"), float_query(call, "known_at")
    include_closed = bool_query(call, "include_closed")
    # Each page reads the rows up to its end, so a listing of any length pages through to its last row.
    page = offset_page(lambda n: call.tenant.facts.list(scope, subject=subject, attribute=attribute, valid_at=valid_at,
                                                        known_at=known_at, include_closed=include_closed, limit=n),
                       parse_limit(call.query("limit")), call.query("cursor"), S.fact)
    if not page["data"]:  # none: for a user the agent has, not for a mistyped id
        known_user(call, scope.agent, scope.user)
    return page


def _user_of_agent(call: Call, scope: Scope) -> bool:
    """404 unless the path's user is one of the agent's end-users, as for a turn (``Router.resolve``): a typo of a
    user id must not become memory of nobody. True: an agent with ``lifecycle.users = "auto"`` is to gain the user."""
    from moorage.lifecycle.config import AgentLifecycle

    agent, user = agent_of(call), scope.user
    if call.tenant.agent_users.find(agent.name, user) is None:
        if AgentLifecycle.of(agent).users != "auto" and not call.tenant.sessions.list(agent.name, user, limit=1):
            raise NotFound(f"agent {agent.name!r} has no user {user!r}",
                           hint=f"create the end-user first (PUT /v1/agents/{agent.name}/users/{user}), "
                                "or set lifecycle.users = \"auto\" on the agent")
        return True
    return False


async def add_fact(call: Call) -> Reply:
    from moorage.memory import FactCandidate

    scope = _scope(call)
    subject, attribute, value = (call.field(n, str) for n in ("subject", "attribute", "value"))
    for name, v in (("subject", subject), ("attribute", attribute), ("value", value)):
        if not v.strip():
            raise InvalidInput(f"{name} must not be empty")
    text = call.field("text", str, required=False) or f"{subject} {attribute}: {value}"
    register = await run_in_threadpool(_user_of_agent, call, scope)
    await tenant_cap.admit(call.ctx.config, call.tenant, len(subject) + len(attribute) + len(value) + len(text),
                           "adding a fact")
    return await run_in_threadpool(_add_fact, call, scope, FactCandidate(subject, attribute, value, text), register)


def _add_fact(call: Call, scope: Scope, fact: Any, register: bool) -> Reply:
    from moorage.memory import SemanticMemory

    # Its own transaction (its retry on a race must not join an outer one); the user registered only with the fact.
    change = SemanticMemory(call.tenant).record(scope, fact, origin="user", evidence=[f"api:{call.trace_id}"])
    if register:
        call.tenant.agent_users.put(scope.agent, scope.user)
    return Reply({"action": change.action, "fact": S.fact(change.fact),
                  "previous": S.fact(change.previous) if change.previous else None}, 201)


def list_pending_facts(call: Call) -> dict[str, Any]:
    scope = _scope(call)
    limit = parse_limit(call.query("limit"))
    after = decode_cursor(call.query("cursor")).get("after")
    if after is not None and not (isinstance(after, list) and len(after) == 2 and isinstance(after[0], (int, float))
                                  and isinstance(after[1], str)):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    # Keyed on (recorded_at, id), not an offset: a fact confirmed or rejected between two pages does not make the
    # next one skip another.
    facts = call.tenant.facts.waiting(scope, after=(float(after[0]), after[1]) if after else None, limit=limit + 1)
    if not facts:  # none waiting: for a user the agent has, not for a mistyped id
        known_user(call, scope.agent, scope.user)
    page = facts[:limit]
    more = len(facts) > limit
    return {"data": [S.fact(f) for f in page],
            "next_cursor": encode_cursor({"after": [page[-1].recorded_at, page[-1].id]}) if more else None}


def _decide(call: Call, verb: str) -> dict[str, Any]:
    from moorage.memory import SemanticMemory

    scope, fact_id = _scope(call), call.path["fact"]
    memory = SemanticMemory(call.tenant)
    if verb == "confirm":
        change = memory.confirm(scope, fact_id, evidence=[f"api:{call.trace_id}"])
    else:
        change = memory.reject(scope, fact_id)
    return {"action": change.action, "fact": S.fact(change.fact),
            "previous": S.fact(change.previous) if change.previous else None}


def confirm_fact(call: Call) -> dict[str, Any]:
    return _decide(call, "confirm")


def reject_fact(call: Call) -> dict[str, Any]:
    return _decide(call, "reject")


_USER = "/v1/agents/{agent}/users/{user}"

ENDPOINTS = [
    Endpoint("GET", "/v1/agents/{agent}/sessions", list_sessions,
             "List sessions (of one user with ?user=), most recently active first",
             "memory", "listSessions", scope="read", end_user=True, query=(*PAGE, Param("user", S.ID, "only this user's sessions")),
             response=S.page_of("Session")),
    Endpoint("GET", f"{_USER}/events", list_events, "List the user's episodic log, oldest first (or newest first)",
             "memory", "listEvents", scope="read", end_user=True,
             query=(*PAGE, SESSION, Param("order", {"enum": ["oldest", "newest"], "default": "oldest"},
                                          "newest: from the log's end, each page older than the last"),
                    Param("kind", S.STR, "only events of this kind (message, summary, …)")),
             response=S.page_of("Event")),
    Endpoint("GET", f"{_USER}/events/search", search_events, "Search the user's episodic memory", "memory",
             "searchEvents", scope="read", end_user=True,
             query=(Param("q", {"type": "string", "minLength": 1}, "what to recall", required=True),
                    Param("k", {"type": "integer", "minimum": 1, "maximum": 500}, "how many results"), SESSION),
             response=S.page_of("Recall")),
    Endpoint("GET", f"{_USER}/facts", list_facts, "List the user's facts (current, as of a time, or as known then)",
             "memory", "listFacts", scope="read", end_user=True,
             query=(*PAGE, SESSION, Param("subject", S.STR), Param("attribute", S.STR),
                    Param("as_of", S.NUM, "facts true at this time"),
                    Param("known_at", S.NUM, "facts as recorded by this time"),
                    Param("include_closed", {"type": "boolean"}, "include superseded facts")),
             response=S.page_of("Fact")),
    Endpoint("POST", f"{_USER}/facts", add_fact, "Add or correct a fact (a new value supersedes the current one)",
             "memory", "addFact", scope="deploy", status=201, query=(SESSION,),
             body=S.obj({"subject": {"type": "string", "minLength": 1}, "attribute": {"type": "string", "minLength": 1},
                         "value": {"type": "string", "minLength": 1}, "text": S.STR},
                        ["subject", "attribute", "value"]),
             response=S.ref("FactChange")),
    Endpoint("GET", f"{_USER}/facts/pending", list_pending_facts,
             "List the user's pending facts (waiting for confirmation), oldest first", "memory", "listPendingFacts",
             scope="read", end_user=True, query=(*PAGE, SESSION), response=S.page_of("Fact")),
    Endpoint("POST", f"{_USER}/facts/{{fact}}/confirm", confirm_fact,
             "Confirm a pending fact: it becomes current from now (and supersedes the current value)", "memory",
             "confirmFact", scope="deploy", query=(SESSION,), response=S.ref("FactChange")),
    Endpoint("POST", f"{_USER}/facts/{{fact}}/reject", reject_fact,
             "Reject a pending fact: it is never believed (kept as rejected for the record)", "memory",
             "rejectFact", scope="deploy", query=(SESSION,), response=S.ref("FactChange")),
]
