"""End-users as a resource of one agent: the product's own user id, its metadata and per-user limits.

The tenant-wide ``end_users`` registry (what the router checks) is kept in step: creating an agent user
registers the end-user too. Reached as ``TenantStore.agent_users``; every method is scoped to the tenant.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import check_id
from moorage.store.sql import loads
from moorage.store.repos.common import _Repo

#: Per-user limits an agent user may carry (all optional, non-negative numbers).
USER_LIMITS: tuple[str, ...] = ("compute_seconds_per_day", "tokens_per_month", "cost_usd_per_month", "store_mib")
_COLS = "agent_id, user_id, meta, limits, created_at, updated_at, version"


@dataclass(frozen=True)
class AgentUser:
    agent: str
    user: str
    meta: dict[str, Any]
    limits: dict[str, float]
    created_at: float
    updated_at: float
    version: int


def _row(r: tuple) -> AgentUser:
    return AgentUser(r[0], r[1], loads(r[2]) or {}, loads(r[3]) or {}, r[4], r[5], r[6])


def check_limits(limits: object) -> dict[str, float]:
    if not isinstance(limits, dict):
        raise InvalidInput("limits must be an object", hint=f"keys: {', '.join(USER_LIMITS)}")
    out: dict[str, float] = {}
    for k, v in limits.items():
        if k not in USER_LIMITS:
            raise InvalidInput(f"unknown limit {k!r}", hint=f"one of {', '.join(USER_LIMITS)}")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v or v == float("inf"):
            raise InvalidInput(f"limit {k!r} must be a non-negative number")
        out[k] = float(v)
    return out


def check_meta(meta: object) -> dict[str, Any]:
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise InvalidInput("metadata must be a JSON object with string keys")
    return meta


def _same(value: Any, wanted: Any) -> bool:
    """A metadata value matches a filter given as itself or, from a query string, as its JSON text."""
    if value == wanted:
        return True
    return isinstance(wanted, str) and not isinstance(value, str) and json.dumps(value) == wanted


#: Per dialect: the JSON type of ``meta``'s value at a key, its text (a string's own), and the names of the types.
_JSON = {
    "sqlite": ("json_type(meta, ?)", "json_extract(meta, ?)",
               {"string": "'text'", "bool": None, "null": "'null'", "int": "'integer'", "number": "'integer', 'real'"}),
    "postgres": ("jsonb_typeof((meta::jsonb) -> CAST(? AS TEXT))", "(meta::jsonb) ->> CAST(? AS TEXT)",
                 {"string": "'string'", "bool": "'boolean'", "null": "'null'", "int": "'number'",
                  "number": "'number'"}),
}


def _narrowing(dialect: str, key: str, wanted: Any) -> tuple[str, list[Any]]:
    """A condition on ``meta`` that every row ``_same`` keeps also meets (the store narrows a page's rows with it,
    ``_same`` decides): the value's JSON type and, where both databases read it as Python does, its value.
    ``("", [])`` when SQL cannot say (a key SQLite's JSON path cannot name)."""
    typ, text, names = _JSON["postgres" if dialect == "postgres" else "sqlite"]
    if dialect == "postgres":
        arg: Any = key
    elif '"' in key or "\\" in key:
        return "", []
    else:
        arg = f'$."{key}"'
    if not isinstance(wanted, str):  # from the store's own callers: Python's equality (1 == 1.0 == True) decides
        return f"{typ} IS NOT NULL", [arg]
    ors, params = [f"({typ} = {names['string']} AND {text} = ?)"], [arg, arg, wanted]
    try:
        j = json.loads(wanted)
    except (ValueError, RecursionError):
        return ors[0], params
    if isinstance(j, bool):  # SQLite's type is the value itself
        ors.append(f"({typ} = {names['bool']} AND {text} = ?)" if names["bool"] else f"{typ} = ?")
        params += [arg, arg, wanted] if names["bool"] else [arg, wanted]
    elif j is None:
        ors.append(f"{typ} = {names['null']}")
        params.append(arg)
    elif isinstance(j, int) and abs(j) < 2 ** 53:  # an integer's text is its value in both databases
        value = f"CAST({text} AS NUMERIC)" if dialect == "postgres" else text
        ors.append(f"({typ} = {names['int']} AND {value} = ?)")
        params += [arg, arg, j]
    elif isinstance(j, (int, float)):  # a float's text may name its value more ways than Python writes it
        ors.append(f"{typ} IN ({names['number']})")
        params.append(arg)
    else:  # an array or an object: Python writes its JSON with its own spacing and escapes
        ors.append(f"{typ} = '{'array' if isinstance(j, list) else 'object'}'")
        params.append(arg)
    return "(" + " OR ".join(ors) + ")", params


class AgentUsers(_Repo):
    def put(self, agent: str, user: str, *, meta: dict[str, Any] | None = None,
            limits: dict[str, Any] | None = None) -> tuple[AgentUser, bool]:
        """Get or create ``user`` of ``agent`` (True when created). Given metadata or limits replace the stored
        ones, so repeating the same call leaves the same state (idempotent)."""
        check_id(agent, "agent name")
        check_id(user, "user id")
        meta_v = None if meta is None else check_meta(meta)
        limits_v = None if limits is None else check_limits(limits)
        now = time.time()
        with self._ts._tx() as c:
            c.x("INSERT INTO end_users (id, created_at, meta) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                (user, now, "{}"))
            n = c.x(f"INSERT INTO agent_users ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, 1) ON CONFLICT DO NOTHING",
                    (agent, user, self._json(meta_v or {}, "user metadata"), self._json(limits_v or {}, "limits"),
                     now, now))
            if n == 1:
                return AgentUser(agent, user, meta_v or {}, limits_v or {}, now, now, 1), True
            cur = _row(c.one(f"SELECT {_COLS} FROM agent_users WHERE agent_id = ? AND user_id = ?", (agent, user)))
            new_meta = cur.meta if meta_v is None else meta_v
            new_limits = cur.limits if limits_v is None else limits_v
            if new_meta == cur.meta and new_limits == cur.limits:
                return cur, False
            n = c.x("UPDATE agent_users SET meta = ?, limits = ?, updated_at = ?, version = version + 1 "
                    "WHERE agent_id = ? AND user_id = ? AND version = ?",
                    (self._json(new_meta, "user metadata"), self._json(new_limits, "limits"), now, agent, user,
                     cur.version))
            if n != 1:
                raise ConflictError(f"user {user!r} of {agent!r} changed concurrently", hint="retry the request")
            return AgentUser(agent, user, new_meta, new_limits, cur.created_at, now, cur.version + 1), False

    def get(self, agent: str, user: str) -> AgentUser:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_COLS} FROM agent_users WHERE agent_id = ? AND user_id = ?", (agent, user))
        if r is None:
            raise NotFound(f"agent {agent!r} has no user {user!r}",
                           hint=f"create it with PUT /v1/agents/{agent}/users/{user}")
        return _row(r)

    def find(self, agent: str, user: str) -> AgentUser | None:
        try:
            return self.get(agent, user)
        except NotFound:
            return None

    def list(self, agent: str, *, limit: int = 50, after: str | None = None,
             meta: Mapping[str, Any] | None = None) -> list[AgentUser]:
        """Users of ``agent`` in id order after ``after``; ``meta`` keeps those whose metadata has every pair (the
        database narrows the rows, ``_same`` decides: a page of a filter few users match is one or two queries)."""
        out: list[AgentUser] = []
        cursor = after or ""
        batch = max(limit, 100)
        where, narrowing = "agent_id = ? AND user_id > ?", []
        for k, v in (meta or {}).items():
            cond, args = _narrowing(self._ts.dialect, k, v)
            if cond:
                where += f" AND {cond}"
                narrowing += args
        while len(out) < limit:
            with self._ts._tx(write=False) as c:
                rows = c.q(f"SELECT {_COLS} FROM agent_users WHERE {where} ORDER BY user_id LIMIT ?",
                           [agent, cursor, *narrowing, batch])
            for r in rows:
                u = _row(r)
                if not meta or all(k in u.meta and _same(u.meta[k], v) for k, v in meta.items()):
                    out.append(u)
                    if len(out) == limit:
                        break
            if len(rows) < batch:
                break
            cursor = rows[-1][1]
        return out

    def delete(self, agent: str, user: str) -> bool:
        """Remove the user from ``agent``; the tenant-wide end-user goes too once no agent has it."""
        with self._ts._tx() as c:
            n = c.x("DELETE FROM agent_users WHERE agent_id = ? AND user_id = ?", (agent, user))
            if not c.one("SELECT 1 FROM agent_users WHERE user_id = ?", (user,)):
                c.x("DELETE FROM end_users WHERE id = ?", (user,))
        return n == 1
