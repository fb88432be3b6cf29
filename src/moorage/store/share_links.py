"""Share links of one tenant: who may open one user's app without an API key, until when, and whether revoked.

The link's token is signed by the host (``runtime/share_links.py``); this row is what makes a link revocable
and listable. Reached as ``TenantStore.share_links``; every method is scoped to the tenant.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from moorage.errors import InvalidInput, NotFound
from moorage.store.model import check_id
from moorage.store.repos.common import _Repo

_COLS = "id, agent_id, user_id, label, created_at, expires_at, revoked_at, version"
#: Longest a link may live (a forgotten link should not open an app for years).
MAX_TTL_S = 365 * 24 * 3600


@dataclass(frozen=True)
class ShareLink:
    id: str
    agent: str
    user: str
    label: str
    created_at: float
    expires_at: float
    revoked_at: float | None
    version: int

    def usable(self, now: float) -> bool:
        return self.revoked_at is None and now < self.expires_at


def _row(r: tuple) -> ShareLink:
    return ShareLink(r[0], r[1], r[2], r[3], float(r[4]), float(r[5]), None if r[6] is None else float(r[6]), int(r[7]))


class ShareLinks(_Repo):
    """``ts.share_links``: links that open one user's app of one agent."""

    def create(self, agent: str, user: str, ttl_s: float, label: str = "") -> ShareLink:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 1 <= ttl_s <= MAX_TTL_S:
            raise InvalidInput(f"ttl must be between 1 second and {MAX_TTL_S // 86400} days",
                               hint="e.g. --ttl 1h or ttl_s = 3600")
        link = ShareLink(uuid.uuid4().hex, check_id(agent, "agent name"), check_id(user, "user id"),
                         self._text(label, "label")[:200], time.time(), time.time() + float(ttl_s), None, 1)
        with self._ts._tx() as c:
            c.x(f"INSERT INTO share_links ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (link.id, link.agent, link.user, link.label, link.created_at, link.expires_at, None, 1))
        return link

    def get(self, link_id: str) -> ShareLink:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_COLS} FROM share_links WHERE id = ?", (str(link_id),))
        if r is None:
            raise NotFound(f"no share link {link_id!r}")
        return _row(r)

    def list(self, agent: str, user: str | None = None) -> list[ShareLink]:
        a = check_id(agent, "agent name")
        with self._ts._tx(write=False) as c:
            if user is None:
                rows = c.q(f"SELECT {_COLS} FROM share_links WHERE agent_id = ? ORDER BY created_at", (a,))
            else:
                rows = c.q(f"SELECT {_COLS} FROM share_links WHERE agent_id = ? AND user_id = ? ORDER BY created_at",
                           (a, check_id(user, "user id")))
        return [_row(r) for r in rows]

    def revoke(self, agent: str, user: str, link_id: str) -> ShareLink:
        """Revoke a link of ``user``'s app (a link of another user or agent is not found)."""
        with self._ts._tx() as c:
            n = c.x("UPDATE share_links SET revoked_at = ?, version = version + 1 "
                    "WHERE id = ? AND agent_id = ? AND user_id = ? AND revoked_at IS NULL",
                    (time.time(), str(link_id), check_id(agent, "agent name"), check_id(user, "user id")))
            r = c.one(f"SELECT {_COLS} FROM share_links WHERE id = ? AND agent_id = ? AND user_id = ?",
                      (str(link_id), agent, user))
        if r is None:
            raise NotFound(f"no share link {link_id!r} for user {user!r} of agent {agent!r}")
        del n
        return _row(r)

    def delete_user(self, user: str, agent: str | None = None) -> int:
        """Forget one end-user's links (of one agent, or of all)."""
        with self._ts._tx() as c:
            if agent is None:
                return c.x("DELETE FROM share_links WHERE user_id = ?", (check_id(user, "user id"),))
            return c.x("DELETE FROM share_links WHERE agent_id = ? AND user_id = ?",
                       (check_id(agent, "agent name"), check_id(user, "user id")))
