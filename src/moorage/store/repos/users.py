"""The tenant-wide end-user registry and the sessions each end-user holds with an agent (a session
opens on first use and touches its scope)."""

from __future__ import annotations

from typing import Any

from moorage.errors import NotFound
from moorage.store.model import EndUser, Scope, Session, check_id
from moorage.store.repos.common import _new_id, _now, _Repo
from moorage.store.sql import loads


class EndUsers(_Repo):
    def ensure(self, user_id: str, meta: dict[str, Any] | None = None) -> EndUser:
        check_id(user_id, "user id")
        with self._ts._tx() as c:
            u = EndUser(user_id, _now(), meta or {})
            n = c.x("INSERT INTO end_users (id, created_at, meta) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                    (u.id, u.created_at, self._json(u.meta)))
            if n == 1:
                return u
            r = c.one("SELECT id, created_at, meta FROM end_users WHERE id = ?", (user_id,))
            return EndUser(r[0], r[1], loads(r[2]))

    def get(self, user_id: str) -> EndUser:
        with self._ts._tx(write=False) as c:
            r = c.one("SELECT id, created_at, meta FROM end_users WHERE id = ?", (user_id,))
        if r is None:
            raise NotFound(f"no user {user_id!r}")
        return EndUser(r[0], r[1], loads(r[2]))

    def list(self, *, limit: int = 100, after: str | None = None) -> list[EndUser]:
        with self._ts._tx(write=False) as c:
            rows = c.q("SELECT id, created_at, meta FROM end_users WHERE id > ? ORDER BY id LIMIT ?", (after or "", limit))
        return [EndUser(r[0], r[1], loads(r[2])) for r in rows]

    def delete(self, user_id: str) -> None:
        with self._ts._tx() as c:
            c.x("DELETE FROM end_users WHERE id = ?", (user_id,))


_SESSION_COLS = "id, agent_id, user_id, created_at, last_active, meta, version"


def _session(r: tuple) -> Session:
    return Session(r[0], r[1], r[2], r[3], r[4], loads(r[5]), r[6])


class Sessions(_Repo):
    def open(self, agent_id: str, user_id: str, session_id: str | None = None, meta: dict[str, Any] | None = None) -> Session:
        """Return the session, creating it (and the end-user) on first use."""
        session_id = session_id or _new_id()
        check_id(session_id, "session id")
        check_id(agent_id, "agent id")
        now = _now()
        with self._ts._tx() as c:
            r = c.one(f"SELECT {_SESSION_COLS} FROM sessions WHERE agent_id = ? AND user_id = ? AND id = ?", (agent_id, user_id, session_id))
            if r:
                c.x("UPDATE sessions SET last_active = ? WHERE agent_id = ? AND user_id = ? AND id = ?", (now, agent_id, user_id, session_id))
                return _session((*r[:4], now, *r[5:]))
            self._ts.users.ensure(user_id)
            n = c.x(
                f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?, ?, ?, ?, ?, ?, 1) ON CONFLICT DO NOTHING",
                (session_id, agent_id, user_id, now, now, self._json(meta or {})),
            )
            if n != 1:  # a concurrent request opened it first
                r = c.one(f"SELECT {_SESSION_COLS} FROM sessions WHERE agent_id = ? AND user_id = ? AND id = ?", (agent_id, user_id, session_id))
                return _session(r)
            self._ts._touch(c, Scope.session(agent_id, user_id, session_id), now)
            return Session(session_id, agent_id, user_id, now, now, meta or {}, 1)

    def page(self, agent_id: str, user_id: str | None = None, *, before: tuple[float, str, str] | None = None,
             limit: int = 100) -> list[Session]:
        """The agent's sessions (of one user, or all), most recently active first, the first ``limit`` after
        ``before`` (the ``(last_active, user_id, id)`` of the last one of the page before): a key, not an offset, so
        a listing reaches every session however many there are, and each page reads its own rows through the
        indexes by activity (migration 22). A session active again during a walk moves ahead of it: it is not listed
        twice (nor, if the walk had not reached it yet, on a later page: re-read the first page to see it)."""
        # Row values: a range of the index (an OR of the same comparisons walks every newer entry of the agent).
        where, params = "agent_id = ?", [agent_id]
        if user_id is not None:
            where += " AND user_id = ?"
            params.append(user_id)
            if before is not None:  # the user is fixed: (last_active, id) is the order within it
                where += " AND (last_active, id) < (?, ?)"
                params += [before[0], before[2]]
        elif before is not None:
            where += " AND (last_active, user_id, id) < (?, ?, ?)"
            params += list(before)
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_SESSION_COLS} FROM sessions WHERE {where} "
                       "ORDER BY last_active DESC, user_id DESC, id DESC LIMIT ?", (*params, limit))
        return [_session(r) for r in rows]

    def list(self, agent_id: str, user_id: str | None = None, *, limit: int = 100) -> list[Session]:
        with self._ts._tx(write=False) as c:
            if user_id is None:
                rows = c.q(f"SELECT {_SESSION_COLS} FROM sessions WHERE agent_id = ? ORDER BY last_active DESC LIMIT ?", (agent_id, limit))
            else:
                rows = c.q(
                    f"SELECT {_SESSION_COLS} FROM sessions WHERE agent_id = ? AND user_id = ? ORDER BY last_active DESC LIMIT ?",
                    (agent_id, user_id, limit),
                )
        return [_session(r) for r in rows]
