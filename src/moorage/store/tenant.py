"""The tenant-scoped store handle: everything a tenant's code may read or write, through its repositories
(one module each under ``moorage.store.repos``).

A ``TenantStore`` is bound to one tenant by an authenticated ``Principal``; no method takes a tenant id.
Every update of a mutable record is compare-and-set on its ``version``; multi-record changes share one
transaction (``with ts.transaction(): ...``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from moorage.store import usage_rollups
from moorage.store.base import StoreContention
from moorage.store.model import Principal, Scope, check_id
from moorage.store.repos.agents import Agents
from moorage.store.repos.common import _now
from moorage.store.repos.common import _Repo as _Repo  # re-exported: repositories in other modules subclass it
from moorage.store.repos.deployments import Deployments
from moorage.store.repos.events import Events
from moorage.store.repos.facts import Facts
from moorage.store.repos.journal import Journal
from moorage.store.repos.keys import ApiKeys
from moorage.store.repos.retention import _AGENT_RETENTION, Retention
from moorage.store.repos.sandboxes import Sandboxes
from moorage.store.repos.spans import Spans
from moorage.store.repos.state import State
from moorage.store.repos.usage import Usage
from moorage.store.repos.users import EndUsers, Sessions
from moorage.store.repos.workflows import WorkflowRuns
from moorage.store.sql import Conn

if TYPE_CHECKING:
    from moorage.store.base import Backend

_T = TypeVar("_T")


class TenantStore:
    """All of one tenant's state. Obtain it with ``Store.tenant(principal)``."""

    def __init__(self, backend: "Backend", principal: Principal, max_value_bytes: int) -> None:
        self._backend = backend
        self.principal = principal
        self.max_value_bytes = max_value_bytes
        self._local = threading.local()
        self.keys = ApiKeys(self)
        self.agents = Agents(self)
        self.deployments = Deployments(self)
        self.users = EndUsers(self)
        self.sessions = Sessions(self)
        self.state = State(self)
        self.events = Events(self)
        self.facts = Facts(self)
        self.runs = WorkflowRuns(self)
        self.journal = Journal(self)
        self.sandboxes = Sandboxes(self)
        self.spans = Spans(self)
        self.usage = Usage(self)
        self.retention = Retention(self)
        from moorage.store.repos.secrets import Secrets as SecretsRepo  # its own module (late: no cycle)

        self.secrets = SecretsRepo(self)
        # Repositories in their own modules outside repos/ (imported late, as before).
        from moorage.store.agent_users import AgentUsers
        from moorage.store.webhooks import Deliveries, Executions, Webhooks

        self.agent_users = AgentUsers(self)
        self.executions = Executions(self)
        self.webhooks = Webhooks(self)
        self.deliveries = Deliveries(self)
        from moorage.store.share_links import ShareLinks

        self.share_links = ShareLinks(self)
        from moorage.store.repos.checkpoints import Checkpoints

        self.checkpoints = Checkpoints(self)
        from moorage.store.repos.footprint import Footprint

        self.footprint = Footprint(self)

    @property
    def tenant_id(self) -> str:
        return self.principal.tenant_id

    @property
    def dialect(self) -> str:
        return self._backend.dialect

    @contextlib.contextmanager
    def transaction(self) -> Iterator["TenantStore"]:
        """Group calls into one atomic transaction; nested uses join the outer one."""
        with self._tx():
            yield self

    @property
    def backend(self) -> "Backend":
        return self._backend

    def ambient(self) -> Conn | None:
        """The connection of the transaction this thread is inside (``with ts.transaction()``), if any."""
        return getattr(self._local, "conn", None)

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run one read-only statement on this tenant's data: inside the current transaction if there is one,
        otherwise as a single statement that is its own consistent snapshot (cheaper than a transaction)."""
        ambient = self.ambient()
        if ambient is not None:
            return ambient.q(sql, params)
        return self._backend.tenant_read(self.principal.tenant_id, sql, params)

    def _retried(self, run: Callable[[], _T]) -> _T:
        """``run()``, a transaction of its own: when the store aborted it for a conflict with a concurrent one (a
        deadlock PostgreSQL broke) it runs again, up to 3 times; not inside a caller's transaction, which the
        abort ended (the caller's own call fails, typed, and is retryable as a whole)."""
        for attempt in range(3):
            try:
                return run()
            except StoreContention:
                if attempt == 2 or self.ambient() is not None:
                    raise
                time.sleep(0.02 * (attempt + 1))
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _tx(self, write: bool = True) -> Iterator[Conn]:
        current: Conn | None = getattr(self._local, "conn", None)
        if current is not None:
            yield current
            return
        with self._backend.tenant_tx(self.principal.tenant_id, write=write) as conn:
            self._local.conn = conn
            try:
                yield conn
            finally:
                self._local.conn = None

    # -- scope bookkeeping shared by the repositories -------------------------------------------

    def _touch(self, c: Conn, scope: Scope, now: float) -> None:
        """Record that ``scope`` holds data and push its expiry out by its kind's TTL."""
        # The kind's TTL and the scope's agent's own TTL (if set): the shorter one wins.
        ttls = [r[0] for r in c.q("SELECT ttl_s FROM retention WHERE kind IN (?, ?)",
                                  (scope.kind, _AGENT_RETENTION + scope.agent)) if r[0] is not None]
        expires = now + min(ttls) if ttls else None
        c.x(
            """INSERT INTO scopes (scope, kind, agent_id, user_id, ref, created_at, last_active, expires_at)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT ({}scope) DO UPDATE SET last_active = excluded.last_active,
                   expires_at = excluded.expires_at""".format("tenant_id, " if self.dialect == "postgres" else ""),
            (scope.key, scope.kind, scope.agent, scope.user, scope.ref, now, now, expires),
        )

    def sweep(self, now: float | None = None) -> "SweepReport":
        """Delete every scope whose TTL has passed, each in one transaction. Returns what went."""
        now = _now() if now is None else now
        with self._tx(write=False) as c:
            expired = [r[0] for r in c.q("SELECT scope FROM scopes WHERE expires_at IS NOT NULL AND expires_at < ?", (now,))]
        removed = 0
        for key in expired:
            with self._tx() as c:
                # Re-check inside the write transaction: a concurrent write may have renewed it.
                row = c.one("SELECT expires_at FROM scopes WHERE scope = ?", (key,))
                if row is None or row[0] is None or row[0] >= now:
                    continue
                removed += _delete_scopes(c, [key])
        removed += self.retention.sweep_records(now)  # finished executions and usage rows past their kind's TTL
        removed += self.journal.sweep_http(now)  # Idempotency-Key answers past their replay window
        # LangGraph values deleted since (or orphaned by a crash before their commit) leave the blob log.
        if self.ambient() is None:
            self._backend.vacuum_blobs(self.tenant_id)
        return SweepReport(scopes=len(expired), rows=removed)

    def knows_user(self, agent: str, user: str) -> bool:
        """Whether ``user`` is one of ``agent``'s end-users: registered (PUT, a turn, a fork), or with a session or an
        instance of the agent. A listing that names an unknown user is an error, not an empty list."""
        return (self.agent_users.find(agent, user) is not None or bool(self.sessions.list(agent, user, limit=1))
                or self.sandboxes.for_scope(Scope.for_user(agent, user)) is not None)

    def forget_user(self, user: str, agent: str | None = None) -> int:
        """Remove everything stored about one end-user (of one agent, or of all agents), in one transaction."""
        check_id(user, "user id")
        if agent is not None:
            check_id(agent, "agent id")
        return self._retried(lambda: self._forget_user(user, agent))

    def _forget_user(self, user: str, agent: str | None) -> int:
        with self._tx() as c:
            if agent is None:
                keys = [r[0] for r in c.q("SELECT scope FROM scopes WHERE user_id = ?", (user,))]
            else:
                keys = [r[0] for r in c.q("SELECT scope FROM scopes WHERE agent_id = ? AND user_id = ?", (agent, user))]
            keys = sorted(set(keys))
            # The ledger rows below span agents: their agents' locks first, in one order (store/usage_rollups.py).
            ledger = [("user_id = ?", [user]) if agent is None else ("agent_id = ? AND user_id = ?", [agent, user])]
            if keys:
                ledger.append((f"scope IN ({','.join('?' * len(keys))})", keys))
            usage_rollups.lock_agents(c, *ledger)
            n = _delete_scopes(c, keys)
            n += self.secrets.delete_user(user, agent)  # the user's own secrets go with them
            n += self.share_links.delete_user(user, agent)  # and every link to their app
            n += self.checkpoints.forget_user(user, agent)  # and their instances' checkpoints
            n += self.executions.delete_user(user, agent)  # and their async turns and execs (messages, output)
            n += self.journal.forget_http(user, agent)  # the stored answers of requests about them
            n += self.spans.forget_user(user, agent)  # and those requests' traces (a turn's go with its scope)
            n += self.deliveries.forget_user(user, agent)  # and the webhook deliveries about them, sent or not
            for where, params in ledger:  # their rows, and their instances' (by scope)
                n += unname_usage(c, where, params)
            if agent is None:
                n += c.x("DELETE FROM sessions WHERE user_id = ?", (user,))
                n += c.x("DELETE FROM end_users WHERE id = ?", (user,))
            else:
                n += c.x("DELETE FROM sessions WHERE agent_id = ? AND user_id = ?", (agent, user))
        if getattr(self._local, "conn", None) is None:  # outside a caller's transaction: make it physical now
            self._backend.purge(self.tenant_id)
        return n


_SCOPED_TABLES = ("state", "events", "facts", "journal", "spans", "sandboxes")


def unname_usage(c: Conn, where: str, params: Sequence[Any]) -> int:
    """Keep the ledger rows matching ``where`` without whom they were about: no user, no details (``meta``: the
    instance, the trace), and each instance's scope replaced by a random name, so that instance's storage levels
    still read as one instance's. The amounts stay under their agent and time: a tenant's and an agent's totals, of
    periods already invoiced too, do not change when a user is forgotten (they dropped by the user's usage)."""
    usage_rollups.lock_agents(c, (where, params))  # the levels' sums are shared with concurrent sleeps
    n = 0
    for (scope,) in c.q(f"SELECT DISTINCT scope FROM usage WHERE ({where}) AND scope IS NOT NULL", params):
        unnamed = f"forgotten:{uuid.uuid4().hex}"
        c.x("UPDATE usage_levels SET scope = ?, user_id = NULL WHERE scope = ?", (unnamed, scope))
        n += c.x("UPDATE usage SET scope = ?, user_id = NULL, meta = '{}' WHERE scope = ?", (unnamed, scope))
    return n + c.x(f"UPDATE usage SET user_id = NULL, meta = '{{}}' WHERE ({where}) AND user_id IS NOT NULL", params)


def _delete_scopes(c: Conn, keys: Sequence[str]) -> int:
    if not keys:
        return 0
    marks = ",".join("?" * len(keys))
    n = 0
    run_ids = [r[0] for r in c.q(f"SELECT id FROM workflow_runs WHERE scope IN ({marks})", keys)]
    if run_ids:
        rmarks = ",".join("?" * len(run_ids))
        n += c.x(f"DELETE FROM steps WHERE run_id IN ({rmarks})", run_ids)
        n += c.x(f"DELETE FROM journal WHERE run_id IN ({rmarks})", run_ids)
    n += c.x(f"DELETE FROM workflow_runs WHERE scope IN ({marks})", keys)
    for table in _SCOPED_TABLES:
        n += c.x(f"DELETE FROM {table} WHERE scope IN ({marks})", keys)
    # Not the scope's usage rows: billed already, they stay (forgetting a user unnames them; the ledger's own TTL
    # deletes rows by age), so the totals of periods already invoiced do not change.
    n += c.x(f"DELETE FROM scopes WHERE scope IN ({marks})", keys)
    # Checkpoints hold images of these rows: an instance that lost a scope to retention loses its checkpoints.
    from moorage.store.repos.checkpoints import forget_instances

    n += forget_instances(c, keys)
    return n


@dataclass(frozen=True)
class SweepReport:
    scopes: int
    rows: int
