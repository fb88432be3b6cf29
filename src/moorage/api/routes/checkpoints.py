"""Checkpoints of one end-user's agent instance: list them (what each turn did, the branches), take one, roll
the instance back to one (sandbox and store state together), fork one into new end-users.

Every route names the agent and the user in its path; the runtime's ``timetravel`` does the work.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.routes._common import CURSOR, LIMIT, known_user
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import InvalidInput
from moorage.fleet.forward import forwarded
from moorage.lifecycle import fleet as fleet_rules
from moorage.lifecycle.manager import Misplaced
from moorage.store import Scope
from moorage.store.model import check_id
from moorage.timetravel import checkpoint_view

_BASE = "/v1/agents/{agent}/users/{user}/checkpoints"

CHECKPOINT = S.obj({"id": S.STR, "object": S.STR, "agent": S.STR, "user": S.STR, "seq": S.INT, "branch": S.STR,
                    "parent_id": S.NSTR, "kind": {"enum": ["turn", "manual", "before-rollback", "fork", "missing"]},
                    "name": S.NSTR, "turn_id": S.NSTR, "summary": S.OBJ, "event_mark": S.INT,
                    "sandbox_id": S.NSTR, "sandbox_checkpoint": S.NSTR, "store_bytes": S.INT, "created_at": S.NUM,
                    "current_branch": {"type": "boolean"}, "in_history": {"type": "boolean"},
                    "restorable": {"type": ["boolean", "null"]}})
LISTING = S.obj({"object": S.STR, "agent": S.STR, "user": S.STR, "head": S.NSTR, "branch": S.NSTR,
                 "store_bytes": S.INT, "sandbox_bytes": {"type": ["integer", "null"]},
                 "data": {"type": "array", "items": CHECKPOINT}, "next_cursor": S.NSTR,
                 "branches": {"type": "array", "items": S.obj({"id": S.STR, "from": S.NSTR, "current": {"type": "boolean"},
                                                               "checkpoints": S.INT, "tip": S.NSTR})}})
ROLLBACK = S.obj({"object": S.STR, "agent": S.STR, "user": S.STR, "rolled_back_to": S.STR, "branch": S.STR,
                  "abandoned": S.obj({"branch": S.STR, "tip": S.STR}), "ms": S.NUM})
FORK = S.obj({"object": S.STR, "agent": S.STR, "user": S.STR, "checkpoint": S.STR, "ms": S.NUM,
              "forks": {"type": "array", "items": S.obj({"user": S.STR, "rows": S.INT, "checkpoint": S.STR,
                                                         "sandbox_id": S.NSTR})}})


def _who(call: Call) -> tuple[str, str]:
    return check_id(call.path["agent"], "agent name"), check_id(call.path["user"], "user id")


async def _forward_to_disk_holder(call: Call, agent: str, user: str) -> None:
    """In a fleet, the listing is answered by the host whose disk holds the instance's newest copy (awake there,
    or asleep since it was last there), so ``restorable`` is the same through every host (docs/fleet.md)."""
    fleet = getattr(getattr(call.runtime, "instances", None), "fleet", None)
    if fleet is None or forwarded.get():
        return
    rec = await run_in_threadpool(call.tenant.sandboxes.for_scope, Scope.for_user(agent, user))
    if rec is not None and await run_in_threadpool(fleet_rules.disk_holder, fleet, rec) is not None:
        raise Misplaced(rec)


def _limit(call: Call) -> int:
    raw = call.query("limit")
    if raw is None:
        return 50
    if not raw.isdigit() or not 1 <= int(raw) <= 500:
        raise InvalidInput("limit must be an integer from 1 to 500")
    return int(raw)


def _cursor(call: Call) -> int | None:
    """The page's cursor: the ``seq`` of the last checkpoint of the page before (the listing is newest first)."""
    raw = call.query("cursor")
    if raw is None:
        return None
    if not raw.isdigit():
        raise InvalidInput("this cursor is not one of this listing's", hint="pass the next_cursor of the page before")
    return int(raw)


async def list_checkpoints(call: Call) -> dict[str, Any]:
    agent, user = _who(call)
    await _forward_to_disk_holder(call, agent, user)
    limit, before = _limit(call), _cursor(call)
    # One more than the page says whether another follows; a later page reads from the newest, past the cursor.
    listed = await call.runtime.timetravel.list(call.who, agent, user,
                                                limit=limit + 1 if before is None else 100_000)
    if not listed["data"] and before is None:  # no checkpoints: for a user the agent has, not for a mistyped id
        await run_in_threadpool(known_user, call, agent, user)
    items = [c for c in listed["data"] if before is None or c["seq"] < before]
    listed["data"] = items[:limit]
    listed["next_cursor"] = str(items[limit - 1]["seq"]) if len(items) > limit else None
    return listed


async def take_checkpoint(call: Call) -> Reply:
    agent, user = _who(call)
    name = call.field("name", str, required=False)
    ck = await call.runtime.timetravel.take(call.who, agent, user, name)
    return Reply(checkpoint_view(ck, current_branch=ck.branch, restorable=True), 201)


async def rollback_checkpoint(call: Call) -> dict[str, Any]:
    agent, user = _who(call)
    return await call.runtime.timetravel.rollback(call.who, agent, user, call.path["checkpoint_id"])


async def fork_checkpoint(call: Call) -> Reply:
    agent, user = _who(call)
    one = call.field("to_user", str, required=False)
    many = call.field("to_users", list, required=False)
    if (one is None) == (many is None):
        raise InvalidInput('name the new user(s): {"to_user": "..."} or {"to_users": ["...", ...]}')
    users = [one] if one is not None else many
    if not all(isinstance(u, str) for u in users):
        raise InvalidInput("to_users must be a list of user ids")
    out = await call.runtime.timetravel.fork(call.who, agent, user, call.path["checkpoint_id"], users)
    return Reply(out, 201)


ENDPOINTS = [
    Endpoint("GET", _BASE, list_checkpoints, "List the checkpoints of a user's instance (what each turn did) and its "
             "branches", "checkpoints", "listCheckpoints", scope="read", also_scopes=("provision",),
             query=(LIMIT, CURSOR), response=LISTING),
    Endpoint("POST", _BASE, take_checkpoint, "Checkpoint a user's instance now (sandbox and store state together)",
             "checkpoints", "takeCheckpoint", scope="provision", status=201, body=S.obj({"name": S.STR}, []),
             response=CHECKPOINT),
    # With an Idempotency-Key, a retried rollback or fork is answered from the HTTP journal and acts once.
    Endpoint("POST", f"{_BASE}/{{checkpoint_id}}/rollback", rollback_checkpoint,
             "Roll a user's instance back to a checkpoint (what came after stays as an abandoned branch)",
             "checkpoints", "rollbackCheckpoint", scope="provision", body=S.obj({}, []), response=ROLLBACK),
    Endpoint("POST", f"{_BASE}/{{checkpoint_id}}/fork", fork_checkpoint,
             "Fork a user's instance at a checkpoint into new end-users (sandbox and store state copied)",
             "checkpoints", "forkCheckpoint", scope="provision", status=201,
             body=S.obj({"to_user": S.STR, "to_users": {"type": "array", "items": S.STR, "minItems": 1,
                                                        "maxItems": 16}}, []),
             response=FORK),
]
