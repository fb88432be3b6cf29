"""The store's half of deleting a whole agent: every end-user of it forgotten (``TenantStore.forget_user``), then
what the agent kept of its own (scopes no user owns, secrets, webhooks and their deliveries, async turns, share
links, checkpoints, traces, its TTL), then its deployments and the agent itself, in one
transaction. Its usage stays in the tenant's totals, under its name, without any user's.

The runtime forgets each user's instances first (runtime/agent_delete.py); an instance still recorded here means
a turn made one meanwhile, and the whole transaction is refused (``InstancesLeft``) so the runtime goes round again.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from moorage.errors import ConflictError
from moorage.store.repos.journal import HTTP_KEYS, replay_mark
from moorage.store.repos.retention import _AGENT_RETENTION
from moorage.store.webhooks import _delete_deliveries

if TYPE_CHECKING:
    from moorage.store.model import Agent
    from moorage.store.tenant import TenantStore

#: Tables whose rows name an agent's end-user by (agent_id, user_id): where a user of the agent is found.
_USER_TABLES = ("agent_users", "sessions", "scopes", "secrets", "executions", "share_links", "checkpoints",
                "checkpoint_heads")


class InstancesLeft(ConflictError):
    """Instances of the agent are still recorded (a turn made one after the runtime forgot the users')."""


def users_of(ts: "TenantStore", agent: str) -> list[str]:
    """Every end-user any row of ``agent`` names (registered or not: a session, a scope, a secret of theirs)."""
    with ts._tx(write=False) as c:
        users: set[str] = set()
        for table in _USER_TABLES:
            users |= {r[0] for r in c.q(f"SELECT DISTINCT user_id FROM {table} WHERE agent_id = ? "
                                        "AND user_id IS NOT NULL AND user_id <> ''", (agent,))}
    return sorted(users)


def forget_agent(ts: "TenantStore", agent: "Agent") -> int:
    """Delete everything ``agent`` kept and the agent itself, in one transaction; rows deleted (or unnamed)."""
    return ts._retried(lambda: _forget_agent(ts, agent))


def _forget_agent(ts: "TenantStore", agent: "Agent") -> int:
    from moorage.store.tenant import _delete_scopes, unname_usage

    name = agent.name  # what rows about the agent name it by (its deployments: by id)
    with ts._tx() as c:
        left = c.one("SELECT count(*) FROM sandboxes WHERE agent_id = ?", (name,))
        if left and int(left[0]):
            raise InstancesLeft(f"agent {name!r} still has {int(left[0])} instance(s)", hint="retry the delete")
        n = sum(ts._forget_user(user, name) for user in users_of(ts, name))
        n += _delete_scopes(c, [r[0] for r in c.q("SELECT scope FROM scopes WHERE agent_id = ?", (name,))])
        for table in ("secrets", "share_links", "executions", "checkpoints", "checkpoint_rows", "checkpoint_heads",
                      "checkpoint_events", "sessions", "agent_users"):
            n += c.x(f"DELETE FROM {table} WHERE agent_id = ?", (name,))
        # The stored answers of requests about its users (``Idempotency-Key``), as a user's forget deletes theirs.
        n += c.x(f"DELETE FROM journal WHERE {HTTP_KEYS} AND status != 'pending' AND substr(step, 1, ?) = ?",
                 (len(replay_mark(name, "")), replay_mark(name, "")))
        n += c.x("DELETE FROM spans WHERE agent_id = ? AND scope IS NULL", (name,))
        n += _delete_spans_naming(c, name)
        hooks = [r[0] for r in c.q("SELECT id FROM webhooks WHERE agent_id = ?", (name,))]
        n += _delete_deliveries(c, "agent_id = ?", (name,))
        for hook in hooks:
            n += _delete_deliveries(c, "webhook_id = ?", (hook,))
        n += c.x("DELETE FROM webhooks WHERE agent_id = ?", (name,))
        n += unname_usage(c, "agent_id = ?", [name])
        n += c.x("DELETE FROM retention WHERE kind = ?", (_AGENT_RETENTION + name,))
        n += c.x("DELETE FROM deployments WHERE agent_id = ?", (agent.id,))
        n += c.x("DELETE FROM agents WHERE id = ?", (agent.id,))
    if ts.ambient() is None:  # outside a caller's transaction: make it physical now
        ts._backend.purge(ts.tenant_id)
    return n


def _delete_spans_naming(c: Any, agent: str) -> int:
    """Delete the spans no scope holds whose attributes name ``agent`` (its API requests, its deploys): the
    LIKE finds candidates, the attributes decide (a name's ``_`` is no wildcard then)."""
    pattern = "%" + agent.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    ids = [sid for sid, attrs in c.q("SELECT span_id, attrs FROM spans WHERE scope IS NULL AND attrs LIKE ? ESCAPE '\\'",
                                     (pattern,))
           if agent in (_attr(attrs, "moorage.agent"), _attr(attrs, "agent"))]
    n = 0
    for i in range(0, len(ids), 500):
        batch = ids[i:i + 500]
        n += c.x(f"DELETE FROM spans WHERE span_id IN ({','.join('?' * len(batch))})", batch)
    return n


def _attr(attrs: Any, key: str) -> Any:
    try:
        return (json.loads(attrs) if isinstance(attrs, (str, bytes)) else attrs or {}).get(key)
    except (ValueError, AttributeError):
        return None
