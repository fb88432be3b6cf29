"""The tenant-scoped store handle and its repositories: everything a tenant's code may read or write.

A ``TenantStore`` is bound to one tenant by an authenticated ``Principal``; no method takes a tenant id.
Every update of a mutable record is compare-and-set on its ``version``; multi-record changes share one
transaction (``with ts.transaction(): ...``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import (
    API_KEY_SCOPES,
    FACT_STATUS,
    FACT_TRUST,
    SCOPE_KINDS,
    Agent,
    ApiKey,
    Deployment,
    EndUser,
    Event,
    Fact,
    JournalEntry,
    Principal,
    Record,
    SandboxRecord,
    Scope,
    Session,
    Span,
    Step,
    UsageEntry,
    WorkflowRun,
    check_id,
)
from moorage.store.sql import Conn, check_text, dumps, loads

if TYPE_CHECKING:
    from moorage.store.base import Backend

_MAX_KEY = 256
_MAX_TEXT = 256 * 1024
_WORD = re.compile(r"[A-Za-z0-9]+")


def _now() -> float:
    return time.time()


def _new_id() -> str:
    return uuid.uuid4().hex


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY or "\x00" in key:
        raise InvalidInput(f"malformed key {key!r}", hint=f"a non-empty string of at most {_MAX_KEY} characters")
    return key


def _check_version(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InvalidInput(f"expected_version must be a non-negative integer, got {v!r}")
    return v


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
        # Repositories in their own modules (they import _Repo from here, hence the late import).
        from moorage.store.agent_users import AgentUsers
        from moorage.store.webhooks import Deliveries, Executions, Webhooks

        self.agent_users = AgentUsers(self)
        self.executions = Executions(self)
        self.webhooks = Webhooks(self)
        self.deliveries = Deliveries(self)
        from moorage.store.share_links import ShareLinks

        self.share_links = ShareLinks(self)

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
        # LangGraph values deleted since (or orphaned by a crash before their commit) leave the blob log.
        if self.ambient() is None:
            self._backend.vacuum_blobs(self.tenant_id)
        return SweepReport(scopes=len(expired), rows=removed)

    def forget_user(self, user: str, agent: str | None = None) -> int:
        """Remove everything stored about one end-user (of one agent, or of all agents), in one transaction."""
        check_id(user, "user id")
        if agent is not None:
            check_id(agent, "agent id")
        with self._tx() as c:
            if agent is None:
                keys = [r[0] for r in c.q("SELECT scope FROM scopes WHERE user_id = ?", (user,))]
            else:
                keys = [r[0] for r in c.q("SELECT scope FROM scopes WHERE agent_id = ? AND user_id = ?", (agent, user))]
            n = _delete_scopes(c, sorted(set(keys)))
            n += self.secrets.delete_user(user, agent)  # the user's own secrets go with them
            n += self.share_links.delete_user(user, agent)  # and every link to their app
            if agent is None:
                n += c.x("DELETE FROM sessions WHERE user_id = ?", (user,))
                n += c.x("DELETE FROM usage WHERE user_id = ?", (user,))
                n += c.x("DELETE FROM end_users WHERE id = ?", (user,))
            else:
                n += c.x("DELETE FROM sessions WHERE agent_id = ? AND user_id = ?", (agent, user))
                n += c.x("DELETE FROM usage WHERE agent_id = ? AND user_id = ?", (agent, user))
        if getattr(self._local, "conn", None) is None:  # outside a caller's transaction: make it physical now
            self._backend.purge(self.tenant_id)
        return n


_SCOPED_TABLES = ("state", "events", "facts", "journal", "spans", "usage", "sandboxes")


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
    n += c.x(f"DELETE FROM scopes WHERE scope IN ({marks})", keys)
    return n


@dataclass(frozen=True)
class SweepReport:
    scopes: int
    rows: int


class _Repo:
    def __init__(self, ts: TenantStore) -> None:
        self._ts = ts

    def _json(self, value: Any, what: str = "value") -> str:
        return dumps(value, self._ts.max_value_bytes, what)

    def _text(self, value: object, what: str) -> str:
        return check_text(value, what, min(self._ts.max_value_bytes, _MAX_TEXT))


# -- API keys ---------------------------------------------------------------------------------


class ApiKeys(_Repo):
    """This tenant's API keys. Secrets are returned once, at creation; only hashes are stored."""

    def create(self, scopes: Sequence[str], label: str = "", agent: str | None = None) -> ApiKey:
        """A new key with ``scopes``; with ``agent`` it may act on that one agent of the tenant only."""
        self._ts.principal.require("admin")
        return self._ts._backend.create_api_key(self._ts.tenant_id, scopes, label, agent)

    def list(self) -> list[ApiKey]:
        return self._ts._backend.list_api_keys(self._ts.tenant_id)

    def revoke(self, key_id: str) -> None:
        self._ts.principal.require("admin")
        self._ts._backend.revoke_api_key(self._ts.tenant_id, key_id)


def _check_scopes(scopes: Sequence[str]) -> frozenset[str]:
    bad = [s for s in scopes if s not in API_KEY_SCOPES]
    if bad or not scopes:
        raise InvalidInput(f"unknown key scopes {bad or scopes!r}", hint=f"choose from {', '.join(API_KEY_SCOPES)}")
    return frozenset(scopes)


# -- agents and deployments -------------------------------------------------------------------


def _agent(r: tuple) -> Agent:
    return Agent(r[0], r[1], loads(r[2]), r[3], r[4], r[5], r[6])


_AGENT_COLS = "id, name, config, live_deployment, created_at, updated_at, version"


class Agents(_Repo):
    def create(self, name: str, config: dict[str, Any] | None = None) -> Agent:
        check_id(name, "agent name")
        now = _now()
        a = Agent(_new_id(), name, config or {}, None, now, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO agents ({_AGENT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (a.id, a.name, self._json(a.config, "agent config"), None, now, now, 1),
            )
            if n != 1:
                raise ConflictError(f"an agent named {name!r} already exists", hint="pick another name or deploy to it")
        return a

    def get(self, name_or_id: str) -> Agent:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_AGENT_COLS} FROM agents WHERE id = ? OR name = ?", (name_or_id, name_or_id))
        if r is None:
            raise NotFound(f"no agent {name_or_id!r}", hint="list agents with `moorage agents` or deploy one")
        return _agent(r)

    def list(self) -> list[Agent]:
        with self._ts._tx(write=False) as c:
            return [_agent(r) for r in c.q(f"SELECT {_AGENT_COLS} FROM agents ORDER BY name")]

    def update(
        self, agent_id: str, *, expected_version: int, config: dict[str, Any] | None = None,
        live_deployment: str | None = None,
    ) -> Agent:
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_AGENT_COLS} FROM agents WHERE id = ?", (agent_id,))
            if cur is None:
                raise NotFound(f"no agent {agent_id!r}")
            a = _agent(cur)
            new_cfg = a.config if config is None else config
            new_live = a.live_deployment if live_deployment is None else live_deployment
            if live_deployment is not None and not c.one(
                "SELECT 1 FROM deployments WHERE id = ? AND agent_id = ?", (live_deployment, agent_id)
            ):
                raise NotFound(f"no deployment {live_deployment!r} of agent {a.name!r}")
            now = _now()
            n = c.x(
                "UPDATE agents SET config = ?, live_deployment = ?, updated_at = ?, version = version + 1 "
                "WHERE id = ? AND version = ?",
                (self._json(new_cfg, "agent config"), new_live, now, agent_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"agent {a.name!r} changed (now version {a.version})", current_version=a.version)
        return Agent(a.id, a.name, new_cfg, new_live, a.created_at, now, expected_version + 1)


def _deployment(r: tuple) -> Deployment:
    return Deployment(r[0], r[1], r[2], loads(r[3]), r[4], r[5], r[6], r[7])


_DEP_COLS = "id, agent_id, number, manifest, package_ref, package_sha256, status, created_at"


class Deployments(_Repo):
    def create(self, agent_id: str, manifest: dict[str, Any], package_ref: str, package_sha256: str) -> Deployment:
        with self._ts._tx() as c:
            if not c.one("SELECT 1 FROM agents WHERE id = ?", (agent_id,)):
                raise NotFound(f"no agent {agent_id!r}")
            row = c.one("SELECT COALESCE(MAX(number), 0) FROM deployments WHERE agent_id = ?", (agent_id,))
            d = Deployment(_new_id(), agent_id, int(row[0]) + 1, manifest, package_ref, package_sha256, "ready", _now())
            c.x(
                f"INSERT INTO deployments ({_DEP_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (d.id, agent_id, d.number, self._json(manifest, "manifest"), package_ref, package_sha256, d.status, d.created_at),
            )
        return d

    def get(self, deployment_id: str) -> Deployment:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_DEP_COLS} FROM deployments WHERE id = ?", (deployment_id,))
        if r is None:
            raise NotFound(f"no deployment {deployment_id!r}")
        return _deployment(r)

    def list(self, agent_id: str) -> list[Deployment]:
        with self._ts._tx(write=False) as c:
            return [_deployment(r) for r in c.q(f"SELECT {_DEP_COLS} FROM deployments WHERE agent_id = ? ORDER BY number", (agent_id,))]


# -- end-users and sessions -------------------------------------------------------------------


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


# -- generic versioned state ------------------------------------------------------------------


class State(_Repo):
    """Versioned key-value records per scope. ``put`` is compare-and-set; 0 means "must not exist"."""

    def get(self, scope: Scope, key: str) -> Record | None:
        _check_key(key)
        with self._ts._tx(write=False) as c:
            r = c.one("SELECT value, version, updated_at FROM state WHERE scope = ? AND key = ?", (scope.key, key))
        return None if r is None else Record(scope, key, loads(r[0]), r[1], r[2])

    def put(self, scope: Scope, key: str, value: Any, *, expected_version: int) -> Record:
        _check_key(key)
        _check_version(expected_version)
        text = self._json(value)
        now = _now()
        with self._ts._tx() as c:
            if expected_version == 0:
                # ON CONFLICT DO NOTHING: two creators racing get one winner and one ConflictError,
                # never a unique-violation that aborts the loser's whole transaction.
                n = c.x(
                    "INSERT INTO state (scope, key, value, version, updated_at) VALUES (?, ?, ?, 1, ?) ON CONFLICT DO NOTHING",
                    (scope.key, key, text, now),
                )
                if n != 1:
                    cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                    raise ConflictError(f"{key!r} already exists in {scope}", current_version=cur[0] if cur else None)
            else:
                n = c.x(
                    "UPDATE state SET value = ?, version = version + 1, updated_at = ? WHERE scope = ? AND key = ? AND version = ?",
                    (text, now, scope.key, key, expected_version),
                )
                if n != 1:
                    cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                    if cur is None:
                        raise ConflictError(f"{key!r} does not exist in {scope}", current_version=0)
                    raise ConflictError(
                        f"{key!r} in {scope} is at version {cur[0]}, not {expected_version}", current_version=cur[0]
                    )
            self._ts._touch(c, scope, now)
        return Record(scope, key, value, expected_version + 1, now)

    def delete(self, scope: Scope, key: str, *, expected_version: int) -> None:
        _check_key(key)
        _check_version(expected_version)
        with self._ts._tx() as c:
            n = c.x("DELETE FROM state WHERE scope = ? AND key = ? AND version = ?", (scope.key, key, expected_version))
            if n != 1:
                cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                raise ConflictError(f"cannot delete {key!r}: version changed", current_version=cur[0] if cur else 0)

    def list(self, scope: Scope, *, prefix: str = "", limit: int = 1000) -> list[Record]:
        with self._ts._tx(write=False) as c:
            rows = c.q(
                "SELECT key, value, version, updated_at FROM state WHERE scope = ? AND key >= ? ORDER BY key LIMIT ?",
                (scope.key, prefix, limit),
            )
        return [Record(scope, r[0], loads(r[1]), r[2], r[3]) for r in rows if r[0].startswith(prefix)]


# -- episodic events --------------------------------------------------------------------------


_EVENT_COLS = "id, scope, ts, kind, speaker, content, meta"


def _event(r: tuple) -> Event:
    return Event(int(r[0]), Scope.parse(r[1]), r[2], r[3], r[4], r[5], loads(r[6]))


@dataclass(frozen=True)
class EventIn:
    kind: str
    content: str
    speaker: str | None = None
    meta: dict[str, Any] | None = None
    ts: float | None = None
    embedding: bytes | None = None


class Events(_Repo):
    """The append-only, time-ordered episodic log of each scope."""

    def append(
        self, scope: Scope, kind: str, content: str, *, speaker: str | None = None,
        meta: dict[str, Any] | None = None, ts: float | None = None, embedding: bytes | None = None,
    ) -> Event:
        return self.append_many(scope, [EventIn(kind, content, speaker, meta, ts, embedding)])[0]

    def append_many(self, scope: Scope, items: Sequence[EventIn]) -> list[Event]:
        now = _now()
        rows = []
        for it in items:
            check_id(it.kind, "event kind")
            if it.speaker is not None:
                check_id(it.speaker, "speaker")
            rows.append((scope.key, it.ts if it.ts is not None else now, it.kind, it.speaker,
                         self._text(it.content, "event content"), self._json(it.meta or {}, "event meta"), it.embedding))
        out = []
        with self._ts._tx() as c:
            for r, it in zip(rows, items):
                got = c.one(
                    "INSERT INTO events (scope, ts, kind, speaker, content, meta, embedding) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    r,
                )
                out.append(Event(int(got[0]), scope, r[1], r[2], r[3], r[4], it.meta or {}))
            self._ts._touch(c, scope, now)
        return out

    def list(
        self, scope: Scope, *, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None, kinds: Sequence[str] | None = None,
        after_seq: int | None = None, limit: int = 100, newest_first: bool = False,
    ) -> list[Event]:
        where, params = self._filters(scope, since, until, speakers)
        if kinds:
            where += " AND kind IN ({})".format(",".join("?" * len(kinds)))
            params += list(kinds)
        if after_seq is not None:
            where += " AND id > ?"
            params.append(after_seq)
            if after_seq > 0 and self._ts.dialect == "sqlite":
                # An incremental read (the memory cache asks for what was written since its last look):
                # with a plain ``scope = ?`` SQLite walks the whole scope in the (scope, ts, id) index to
                # find a handful of new rows. ``+scope`` takes that index out of the running, so the
                # rowid range ``id > ?`` is searched instead and the scope is checked per new row.
                where = "+" + where
        order = "DESC" if newest_first else "ASC"
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_EVENT_COLS} FROM events WHERE {where} ORDER BY ts {order}, id {order} LIMIT ?", (*params, limit))
        return [_event(r) for r in rows]

    def count(self, scope: Scope) -> int:
        with self._ts._tx(write=False) as c:
            return int(c.one("SELECT COUNT(*) FROM events WHERE scope = ?", (scope.key,))[0])

    @staticmethod
    def _filters(scope: Scope, since: float | None, until: float | None, speakers: Sequence[str] | None,
                 col: str = "") -> tuple[str, list[Any]]:
        where = f"{col}scope = ?"
        params: list[Any] = [scope.key]
        if since is not None:
            where += f" AND {col}ts >= ?"
            params.append(since)
        if until is not None:
            where += f" AND {col}ts <= ?"
            params.append(until)
        if speakers:
            where += f" AND {col}speaker IN ({','.join('?' * len(speakers))})"
            params += list(speakers)
        return where, params

    def search_text(
        self, scope: Scope, query: str, *, limit: int = 50, since: float | None = None,
        until: float | None = None, speakers: Sequence[str] | None = None,
    ) -> list[tuple[Event, float]]:
        """Lexical search within one scope; any query word may match, best matches first (higher score)."""
        words = [w.lower() for w in _WORD.findall(query)][:64]
        if not words:
            return []
        where, params = self._filters(scope, since, until, speakers, col="e.")
        with self._ts._tx(write=False) as c:
            if self._ts.dialect == "postgres":
                tsq = " | ".join(words)
                rows = c.q(
                    f"SELECT e.id, e.scope, e.ts, e.kind, e.speaker, e.content, e.meta, "
                    f"ts_rank(e.tsv, to_tsquery('english', ?)) AS score FROM events e "
                    f"WHERE {where} AND e.tsv @@ to_tsquery('english', ?) ORDER BY score DESC, e.id DESC LIMIT ?",
                    (tsq, *params, tsq, limit),
                )
            else:
                fts = " OR ".join(f'"{w}"' for w in words)
                rows = c.q(
                    f"SELECT e.id, e.scope, e.ts, e.kind, e.speaker, e.content, e.meta, -bm25(events_fts) AS score "
                    f"FROM events_fts JOIN events e ON e.id = events_fts.rowid "
                    f"WHERE events_fts MATCH ? AND {where} ORDER BY score DESC, e.id DESC LIMIT ?",
                    (fts, *params, limit),
                )
        return [(_event(r[:7]), float(r[7])) for r in rows]

    def put_embeddings(self, scope: Scope, items: Sequence[tuple[int, bytes]]) -> None:
        with self._ts._tx() as c:
            for event_id, vec in items:
                if not isinstance(vec, (bytes, bytearray)) or len(vec) > 64 * 1024:
                    raise InvalidInput("an embedding must be at most 64 KiB of bytes")
                c.x("UPDATE events SET embedding = ? WHERE scope = ? AND id = ?", (bytes(vec), scope.key, event_id))

    def embeddings(
        self, scope: Scope, *, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None, ids: Sequence[int] | None = None,
    ) -> list[tuple[int, bytes]]:
        where, params = self._filters(scope, since, until, speakers)
        if ids is not None:
            if not ids:
                return []
            where += f" AND id IN ({','.join('?' * len(ids))})"
            params += [int(i) for i in ids]
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT id, embedding FROM events WHERE {where} AND embedding IS NOT NULL ORDER BY id", params)
        return [(int(r[0]), bytes(r[1])) for r in rows]

    def unembedded(self, *, after: int = 0, limit: int = 256) -> list[Event]:
        """Events of any scope still waiting for their embedding (NULL) with ids above ``after``, oldest first
        (a partial index, migration 10)."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_EVENT_COLS} FROM events WHERE embedding IS NULL AND id > ? ORDER BY id LIMIT ?",
                       (after, limit))
        return [_event(r) for r in rows]

    def get_many(self, scope: Scope, ids: Sequence[int]) -> list[Event]:
        if not ids:
            return []
        # ``+scope`` on SQLite: otherwise the planner prefers the scope index and scans the whole scope
        # (1 ms at 10k events) instead of looking up each id by rowid (0.02 ms for 20 ids). The scope
        # is still checked on every row, so an id from another scope is never returned.
        col = "+scope" if self._ts.dialect == "sqlite" else "scope"
        with self._ts._tx(write=False) as c:
            rows = c.q(
                f"SELECT {_EVENT_COLS} FROM events WHERE {col} = ? AND id IN ({','.join('?' * len(ids))})",
                (scope.key, *ids),
            )
        by_id = {int(r[0]): _event(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]


# -- semantic facts ---------------------------------------------------------------------------


_FACT_COLS = (
    "id, scope, subject, attribute, value, text, valid_from, valid_to, recorded_at, superseded_at, "
    "superseded_by, trust, status, provenance, source, version"
)


def _fact(r: tuple) -> Fact:
    return Fact(r[0], Scope.parse(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12],
                tuple(loads(r[13])), r[14], r[15])


class Facts(_Repo):
    """Raw fact rows; the supersede/merge rules live in ``moorage.memory.semantic``."""

    def insert(
        self, scope: Scope, subject: str, attribute: str, value: str, text: str, *, valid_from: float | None = None,
        trust: str = "user_stated", status: str = "active", provenance: Sequence[str] = (), source: str = "user",
    ) -> Fact:
        if trust not in FACT_TRUST:
            raise InvalidInput(f"unknown trust {trust!r}", hint=f"one of {', '.join(FACT_TRUST)}")
        if status not in FACT_STATUS:
            raise InvalidInput(f"unknown fact status {status!r}", hint=f"one of {', '.join(FACT_STATUS)}")
        now = _now()
        f = Fact(
            _new_id(), scope, self._text(subject, "subject"), self._text(attribute, "attribute"),
            self._text(value, "value"), self._text(text, "text"), now if valid_from is None else valid_from, None, now,
            None, None, trust, status, tuple(str(p) for p in provenance), self._text(source, "source"), 1,
        )
        with self._ts._tx() as c:
            c.x(
                f"INSERT INTO facts ({_FACT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (f.id, scope.key, f.subject, f.attribute, f.value, f.text, f.valid_from, None, now, None, None, trust,
                 status, self._json(list(f.provenance), "provenance"), f.source, 1),
            )
            self._ts._touch(c, scope, now)
        return f

    def get(self, fact_id: str) -> Fact:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_FACT_COLS} FROM facts WHERE id = ?", (fact_id,))
        if r is None:
            raise NotFound(f"no fact {fact_id!r}")
        return _fact(r)

    def update(
        self, fact_id: str, *, expected_version: int, valid_to: float | None = None, superseded_by: str | None = None,
        status: str | None = None, provenance: Sequence[str] | None = None, trust: str | None = None,
    ) -> Fact:
        """Compare-and-set change of a fact's lifecycle fields (its content never changes)."""
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_FACT_COLS} FROM facts WHERE id = ?", (fact_id,))
            if cur is None:
                raise NotFound(f"no fact {fact_id!r}")
            f = _fact(cur)
            now = _now()
            new = Fact(
                f.id, f.scope, f.subject, f.attribute, f.value, f.text, f.valid_from,
                f.valid_to if valid_to is None else valid_to, f.recorded_at,
                f.superseded_at if superseded_by is None else now, f.superseded_by if superseded_by is None else superseded_by,
                f.trust if trust is None else trust, f.status if status is None else status,
                f.provenance if provenance is None else tuple(provenance), f.source, expected_version + 1,
            )
            if new.status not in FACT_STATUS or new.trust not in FACT_TRUST:
                raise InvalidInput("unknown fact status or trust")
            n = c.x(
                "UPDATE facts SET valid_to = ?, superseded_at = ?, superseded_by = ?, trust = ?, status = ?, provenance = ?, "
                "version = version + 1 WHERE id = ? AND version = ?",
                (new.valid_to, new.superseded_at, new.superseded_by, new.trust, new.status,
                 self._json(list(new.provenance), "provenance"), fact_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"fact {fact_id} changed (now version {f.version})", current_version=f.version)
        return new

    def close(self, fact_id: str, *, expected_version: int, valid_to: float, superseded_by: str | None = None) -> Fact:
        return self.update(fact_id, expected_version=expected_version, valid_to=valid_to, superseded_by=superseded_by)

    def list(
        self, scope: Scope, *, subject: str | None = None, attribute: str | None = None, valid_at: float | None = None,
        known_at: float | None = None, include_closed: bool = False, statuses: Sequence[str] = ("active",),
        limit: int = 1000,
    ) -> list[Fact]:
        """Facts of a scope. ``valid_at``: true at that time; ``known_at``: as recorded by then (bi-temporal)."""
        where = "scope = ?"
        params: list[Any] = [scope.key]
        if subject is not None:
            where += " AND subject = ?"
            params.append(subject)
        if attribute is not None:
            where += " AND attribute = ?"
            params.append(attribute)
        if statuses:
            where += f" AND status IN ({','.join('?' * len(statuses))})"
            params += list(statuses)
        if known_at is not None:
            where += " AND recorded_at <= ? AND (superseded_at IS NULL OR superseded_at > ?)"
            params += [known_at, known_at]
        if valid_at is not None:
            where += " AND valid_from <= ? AND (valid_to IS NULL OR valid_to > ?)"
            params += [valid_at, valid_at]
        elif not include_closed and known_at is None:
            where += " AND valid_to IS NULL"
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_FACT_COLS} FROM facts WHERE {where} ORDER BY valid_from, recorded_at LIMIT ?", (*params, limit))
        return [_fact(r) for r in rows]


# -- workflows, steps and the side-effect journal ---------------------------------------------


_RUN_COLS = "id, scope, name, status, input, state, current_step, result, error, created_at, updated_at, version"
RUN_STATUSES = ("pending", "running", "waiting", "succeeded", "failed", "cancelled")


def _run(r: tuple) -> WorkflowRun:
    return WorkflowRun(r[0], Scope.parse(r[1]), r[2], r[3], loads(r[4]), loads(r[5]), r[6], loads(r[7]), r[8], r[9], r[10], r[11])


_STEP_COLS = "run_id, seq, name, status, attempts, result, error, started_at, finished_at"


def _step(r: tuple) -> Step:
    return Step(r[0], r[1], r[2], r[3], r[4], loads(r[5]), r[6], r[7], r[8])


class WorkflowRuns(_Repo):
    """Workflow runs with checkpointed state, and their step log."""

    def create(self, scope: Scope, name: str, input: Any = None, *, run_id: str | None = None) -> WorkflowRun:
        run_id = run_id or (scope.ref if scope.kind == "workflow" else None) or _new_id()
        check_id(run_id, "run id")
        check_id(name, "workflow name")
        now = _now()
        run = WorkflowRun(run_id, scope, name, "pending", input, {}, None, None, None, now, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO workflow_runs ({_RUN_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, scope.key, name, "pending", self._json(input, "workflow input"), "{}", None, None, None, now, now, 1),
            )
            if n != 1:
                raise ConflictError(f"workflow run {run_id!r} already exists", current_version=None)
            self._ts._touch(c, scope, now)
        return run

    def get(self, run_id: str) -> WorkflowRun:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE id = ?", (run_id,))
        if r is None:
            raise NotFound(f"no workflow run {run_id!r}")
        return _run(r)

    def list(self, *, status: Sequence[str] | None = None, scope: Scope | None = None, limit: int = 100) -> list[WorkflowRun]:
        where, params = "1 = 1", []
        if status:
            where += f" AND status IN ({','.join('?' * len(status))})"
            params += list(status)
        if scope is not None:
            where += " AND scope = ?"
            params.append(scope.key)
        with self._ts._tx(write=False) as c:
            return [_run(r) for r in c.q(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE {where} ORDER BY updated_at LIMIT ?", (*params, limit))]

    _UNSET: Any = object()

    def update(
        self, run_id: str, *, expected_version: int, status: str | None = None, state: dict[str, Any] | None = None,
        current_step: Any = _UNSET, result: Any = _UNSET, error: Any = _UNSET,
    ) -> WorkflowRun:
        _check_version(expected_version)
        if status is not None and status not in RUN_STATUSES:
            raise InvalidInput(f"unknown run status {status!r}", hint=f"one of {', '.join(RUN_STATUSES)}")
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE id = ?", (run_id,))
            if cur is None:
                raise NotFound(f"no workflow run {run_id!r}")
            r = _run(cur)
            now = _now()
            new = WorkflowRun(
                r.id, r.scope, r.name, r.status if status is None else status, r.input, r.state if state is None else state,
                r.current_step if current_step is self._UNSET else current_step, r.result if result is self._UNSET else result,
                r.error if error is self._UNSET else error, r.created_at, now, expected_version + 1,
            )
            n = c.x(
                "UPDATE workflow_runs SET status = ?, state = ?, current_step = ?, result = ?, error = ?, updated_at = ?, "
                "version = version + 1 WHERE id = ? AND version = ?",
                (new.status, self._json(new.state, "workflow state"), new.current_step,
                 None if new.result is None else self._json(new.result, "workflow result"), new.error, now, run_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"workflow run {run_id} changed (now version {r.version})", current_version=r.version)
        return new

    def record_step(
        self, run_id: str, seq: int, name: str, status: str, *, attempts: int = 1, result: Any = None,
        error: str | None = None, started_at: float | None = None, finished_at: float | None = None,
    ) -> Step:
        """Insert or replace the log entry of one step attempt (the log of attempts, failures and corrections)."""
        now = _now()
        st = Step(run_id, seq, name, status, attempts, result, error, started_at or now, finished_at)
        with self._ts._tx() as c:
            if not c.one("SELECT 1 FROM workflow_runs WHERE id = ?", (run_id,)):
                raise NotFound(f"no workflow run {run_id!r}")
            c.x("DELETE FROM steps WHERE run_id = ? AND seq = ?", (run_id, seq))
            c.x(
                f"INSERT INTO steps ({_STEP_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, seq, name, status, attempts, None if result is None else self._json(result, "step result"),
                 error, st.started_at, finished_at),
            )
        return st

    def steps(self, run_id: str) -> list[Step]:
        with self._ts._tx(write=False) as c:
            return [_step(r) for r in c.q(f"SELECT {_STEP_COLS} FROM steps WHERE run_id = ? ORDER BY seq", (run_id,))]


_JOURNAL_COLS = "key, run_id, step, status, result, error, created_at, updated_at, version"


def _journal(r: tuple) -> JournalEntry:
    return JournalEntry(r[0], r[1], r[2], r[3], loads(r[4]), r[5], r[6], r[7], r[8])


class Journal(_Repo):
    """Side effects keyed by idempotency key: claimed, then completed exactly once."""

    def get(self, key: str) -> JournalEntry | None:
        _check_key(key)
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
        return None if r is None else _journal(r)

    def claim(self, key: str, *, run_id: str | None = None, step: str | None = None, scope: Scope | None = None) -> tuple[JournalEntry, bool]:
        """Return the entry for ``key``, creating it as ``pending``; the bool says whether this call created it."""
        _check_key(key)
        now = _now()
        with self._ts._tx() as c:
            n = c.x(
                "INSERT INTO journal (key, scope, run_id, step, status, result, error, created_at, updated_at, version) "
                "VALUES (?, ?, ?, ?, 'pending', NULL, NULL, ?, ?, 1) ON CONFLICT DO NOTHING",
                (key, scope.key if scope else None, run_id, step, now, now),
            )
            if n != 1:
                r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
                return _journal(r), False
            if scope is not None:
                self._ts._touch(c, scope, now)
        return JournalEntry(key, run_id, step, "pending", None, None, now, now, 1), True

    def complete(self, key: str, *, expected_version: int, result: Any = None, error: str | None = None) -> JournalEntry:
        _check_version(expected_version)
        status = "failed" if error is not None else "done"
        now = _now()
        with self._ts._tx() as c:
            n = c.x(
                "UPDATE journal SET status = ?, result = ?, error = ?, updated_at = ?, version = version + 1 "
                "WHERE key = ? AND version = ? AND status = 'pending'",
                (status, None if result is None else self._json(result, "journal result"), error, now, key, expected_version),
            )
            if n != 1:
                cur = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
                if cur is None:
                    raise NotFound(f"no journal entry {key!r}")
                raise ConflictError(f"journal entry {key!r} is {cur[3]} at version {cur[8]}", current_version=cur[8])
            r = c.one(f"SELECT {_JOURNAL_COLS} FROM journal WHERE key = ?", (key,))
        return _journal(r)

    def release(self, key: str, *, expected_version: int) -> None:
        """Drop a pending claim whose side effect failed before it happened, so a retry may claim it again."""
        with self._ts._tx() as c:
            c.x("DELETE FROM journal WHERE key = ? AND version = ? AND status = 'pending'", (key, expected_version))

    def list(self, *, run_id: str | None = None, limit: int = 1000) -> list[JournalEntry]:
        with self._ts._tx(write=False) as c:
            if run_id is None:
                rows = c.q(f"SELECT {_JOURNAL_COLS} FROM journal ORDER BY created_at LIMIT ?", (limit,))
            else:
                rows = c.q(f"SELECT {_JOURNAL_COLS} FROM journal WHERE run_id = ? ORDER BY created_at LIMIT ?", (run_id, limit))
        return [_journal(r) for r in rows]


# -- sandbox records --------------------------------------------------------------------------


_SBX_COLS = "id, agent_id, scope, state, host, snapshot_ref, disk_ref, template_ref, last_active, ttl_s, meta, created_at, version"


def _sandbox(r: tuple) -> SandboxRecord:
    return SandboxRecord(r[0], r[1], Scope.parse(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9], loads(r[10]), r[11], r[12])


class Sandboxes(_Repo):
    """Where each agent instance's sandbox is and what state it is in (placement lives here, not in memory)."""

    def create(self, scope: Scope, *, state: str, host: str | None = None, template_ref: str | None = None,
               ttl_s: float | None = None, meta: dict[str, Any] | None = None, sandbox_id: str | None = None) -> SandboxRecord:
        now = _now()
        rec = SandboxRecord(sandbox_id or _new_id(), scope.agent, scope, state, host, None, None, template_ref, now, ttl_s,
                            meta or {}, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO sandboxes ({_SBX_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1) ON CONFLICT DO NOTHING",
                (rec.id, rec.agent_id, scope.key, state, host, None, None, template_ref, now, ttl_s, self._json(rec.meta), now),
            )
            if n != 1:
                existing = c.one("SELECT id, version FROM sandboxes WHERE scope = ?", (scope.key,))
                raise ConflictError(f"{scope} already has a sandbox", current_version=existing[1] if existing else None)
            self._ts._touch(c, scope, now)
        return rec

    def get(self, sandbox_id: str) -> SandboxRecord:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE id = ?", (sandbox_id,))
        if r is None:
            raise NotFound(f"no sandbox {sandbox_id!r}")
        return _sandbox(r)

    def for_scope(self, scope: Scope) -> SandboxRecord | None:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE scope = ?", (scope.key,))
        return None if r is None else _sandbox(r)

    def list(self, *, states: Sequence[str] | None = None, host: str | None = None, agent_id: str | None = None,
             limit: int = 1000) -> list[SandboxRecord]:
        where, params = "1 = 1", []
        if states:
            where += f" AND state IN ({','.join('?' * len(states))})"
            params += list(states)
        if host is not None:
            where += " AND host = ?"
            params.append(host)
        if agent_id is not None:
            where += " AND agent_id = ?"
            params.append(agent_id)
        with self._ts._tx(write=False) as c:
            return [_sandbox(r) for r in c.q(f"SELECT {_SBX_COLS} FROM sandboxes WHERE {where} ORDER BY last_active LIMIT ?", (*params, limit))]

    _UNSET: Any = object()

    def update(self, sandbox_id: str, *, expected_version: int, state: str | None = None, host: Any = _UNSET,
               snapshot_ref: Any = _UNSET, disk_ref: Any = _UNSET, last_active: float | None = None,
               meta: dict[str, Any] | None = None) -> SandboxRecord:
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE id = ?", (sandbox_id,))
            if cur is None:
                raise NotFound(f"no sandbox {sandbox_id!r}")
            r = _sandbox(cur)
            u = self._UNSET
            new = SandboxRecord(
                r.id, r.agent_id, r.scope, r.state if state is None else state, r.host if host is u else host,
                r.snapshot_ref if snapshot_ref is u else snapshot_ref, r.disk_ref if disk_ref is u else disk_ref,
                r.template_ref, r.last_active if last_active is None else last_active, r.ttl_s,
                r.meta if meta is None else meta, r.created_at, expected_version + 1,
            )
            n = c.x(
                "UPDATE sandboxes SET state = ?, host = ?, snapshot_ref = ?, disk_ref = ?, last_active = ?, meta = ?, "
                "version = version + 1 WHERE id = ? AND version = ?",
                (new.state, new.host, new.snapshot_ref, new.disk_ref, new.last_active, self._json(new.meta), sandbox_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"sandbox {sandbox_id} changed (now version {r.version}, state {r.state})", current_version=r.version)
            self._ts._touch(c, r.scope, _now())
        return new

    def delete(self, sandbox_id: str, *, expected_version: int) -> None:
        with self._ts._tx() as c:
            n = c.x("DELETE FROM sandboxes WHERE id = ? AND version = ?", (sandbox_id, expected_version))
            if n != 1:
                cur = c.one("SELECT version FROM sandboxes WHERE id = ?", (sandbox_id,))
                raise ConflictError(f"cannot delete sandbox {sandbox_id}: it changed", current_version=cur[0] if cur else None)


# -- traces and usage -------------------------------------------------------------------------


_SPAN_COLS = "trace_id, span_id, parent_id, name, start_ts, end_ts, status, attrs, scope"


def _span(r: tuple) -> Span:
    return Span(r[0], r[1], r[2], r[3], r[4], r[5], r[6], loads(r[7]), Scope.parse(r[8]) if r[8] else None)


class Spans(_Repo):
    def record(self, span: Span) -> None:
        with self._ts._tx() as c:
            c.x("DELETE FROM spans WHERE span_id = ?", (span.span_id,))
            c.x(
                f"INSERT INTO spans ({_SPAN_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (span.trace_id, span.span_id, span.parent_id, span.name, span.start_ts, span.end_ts, span.status,
                 self._json(span.attrs, "span attributes"), span.scope.key if span.scope else None),
            )
            if span.scope is not None:
                self._ts._touch(c, span.scope, _now())

    def trace(self, trace_id: str) -> list[Span]:
        with self._ts._tx(write=False) as c:
            return [_span(r) for r in c.q(f"SELECT {_SPAN_COLS} FROM spans WHERE trace_id = ? ORDER BY start_ts", (trace_id,))]

    def recent(self, *, limit: int = 100) -> list[Span]:
        with self._ts._tx(write=False) as c:
            return [_span(r) for r in c.q(f"SELECT {_SPAN_COLS} FROM spans ORDER BY start_ts DESC LIMIT ?", (limit,))]


USAGE_KINDS = ("input_tokens", "output_tokens", "cached_input_tokens", "compute_seconds", "storage_bytes", "cost_usd", "wakes",
               # Levels, not amounts: an instance's bytes at each sleep (read as gauges by moorage.usage.ledger).
               "disk_bytes", "snapshot_bytes")


class Usage(_Repo):
    """The usage ledger: append-only amounts per kind, summed for reports and budgets."""

    def add(self, kind: str, amount: float, *, agent_id: str | None = None, user_id: str | None = None,
            scope: Scope | None = None, meta: dict[str, Any] | None = None, ts: float | None = None) -> None:
        if kind not in USAGE_KINDS:
            raise InvalidInput(f"unknown usage kind {kind!r}", hint=f"one of {', '.join(USAGE_KINDS)}")
        with self._ts._tx() as c:
            c.x(
                "INSERT INTO usage (ts, kind, amount, agent_id, user_id, scope, meta) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ts or _now(), kind, float(amount), agent_id, user_id, scope.key if scope else None, self._json(meta or {})),
            )

    def totals(self, *, since: float | None = None, agent_id: str | None = None, user_id: str | None = None) -> dict[str, float]:
        where, params = "ts >= ?", [since or 0.0]
        if agent_id is not None:
            where += " AND agent_id = ?"
            params.append(agent_id)
        if user_id is not None:
            where += " AND user_id = ?"
            params.append(user_id)
        with self._ts._tx(write=False) as c:
            return {r[0]: float(r[1]) for r in c.q(f"SELECT kind, SUM(amount) FROM usage WHERE {where} GROUP BY kind", params)}

    def entries(self, *, limit: int = 100) -> list[UsageEntry]:
        with self._ts._tx(write=False) as c:
            rows = c.q("SELECT id, ts, kind, amount, agent_id, user_id, meta FROM usage ORDER BY id DESC LIMIT ?", (limit,))
        return [UsageEntry(int(r[0]), r[1], r[2], r[3], r[4], r[5], loads(r[6])) for r in rows]


class Retention(_Repo):
    """Time to live per scope kind and per agent; the sweeper deletes a scope's data once it has been idle
    for the shorter of its kind's and its agent's TTL."""

    def set(self, kind: str, ttl_s: float | None) -> None:
        if kind not in SCOPE_KINDS:
            raise InvalidInput(f"unknown scope kind {kind!r}", hint=f"one of {', '.join(SCOPE_KINDS)}")
        self._put(kind, _check_ttl(ttl_s))

    def set_agent(self, agent: str, ttl_s: float | None) -> None:
        """Every scope of ``agent`` (sessions, users, workflows) is swept once idle ``ttl_s`` seconds, or sooner
        if its kind's TTL is shorter; None: the agent adds no limit of its own."""
        check_id(agent, "agent id")
        self._put(_AGENT_RETENTION + agent, _check_ttl(ttl_s))

    def _put(self, key: str, ttl_s: float | None) -> None:
        pk = "tenant_id, " if self._ts.dialect == "postgres" else ""
        with self._ts._tx() as c:
            if ttl_s is None and key.startswith(_AGENT_RETENTION):
                c.x("DELETE FROM retention WHERE kind = ?", (key,))
            else:
                c.x(f"INSERT INTO retention (kind, ttl_s) VALUES (?, ?) ON CONFLICT ({pk}kind) "
                    "DO UPDATE SET ttl_s = excluded.ttl_s", (key, ttl_s))
            # Re-derive the expiry of existing scopes so the new policy applies to them too: per kind, then
            # tightened for each agent with a shorter TTL of its own.
            rows = dict(c.q("SELECT kind, ttl_s FROM retention"))
            for kind in SCOPE_KINDS:
                ttl = rows.get(kind)
                if ttl is None:
                    c.x("UPDATE scopes SET expires_at = NULL WHERE kind = ?", (kind,))
                else:
                    c.x("UPDATE scopes SET expires_at = last_active + ? WHERE kind = ?", (ttl, kind))
                for name, agent_ttl in rows.items():
                    if name.startswith(_AGENT_RETENTION) and agent_ttl is not None and (ttl is None or agent_ttl < ttl):
                        c.x("UPDATE scopes SET expires_at = last_active + ? WHERE kind = ? AND agent_id = ?",
                            (agent_ttl, kind, name[len(_AGENT_RETENTION):]))

    def get(self) -> dict[str, float | None]:
        """TTL per scope kind."""
        with self._ts._tx(write=False) as c:
            return {r[0]: r[1] for r in c.q("SELECT kind, ttl_s FROM retention") if not r[0].startswith(_AGENT_RETENTION)}

    def agents(self) -> dict[str, float]:
        """TTL per agent that has one of its own."""
        with self._ts._tx(write=False) as c:
            return {r[0][len(_AGENT_RETENTION):]: r[1] for r in c.q("SELECT kind, ttl_s FROM retention")
                    if r[0].startswith(_AGENT_RETENTION) and r[1] is not None}


#: Rows of the retention table keyed by this prefix and an agent id hold that agent's own TTL (kinds never
#: contain a colon, so the two cannot collide).
_AGENT_RETENTION = "agent:"


def _check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
        raise InvalidInput(f"ttl_s must be a positive number of seconds, not {ttl_s!r}",
                           hint="give the idle seconds after which data is deleted, or null (None) to keep it forever")
    return ttl_s
