"""The backend interface every store backend implements (SQLite embedded, PostgreSQL at scale).

A backend knows how to open a transaction bound to one tenant, run the control plane (tenants, API
keys) and migrate its schema; the repositories in ``tenant.py`` hold all the SQL that is shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Collection, Iterator, Sequence

from moorage.errors import InvalidInput, NotFound, TenantScopeError, UnavailableError
from moorage.store.model import AGENT_SCOPE_PREFIX, ApiKey, Tenant, check_id, split_scopes
from moorage.store.sql import Conn

if TYPE_CHECKING:
    from moorage.store.bloblog import BlobLog

_TENANT_ID = re.compile(r"^[0-9a-f]{32}$")
KEY_PREFIX = "mrg_"


#: A ``Tenant``'s columns, in its fields' order.
_TENANT_COLUMNS = "id, name, created_at, version, deleting_since"


def check_tenant_id(tenant_id: str) -> str:
    if not isinstance(tenant_id, str) or not _TENANT_ID.fullmatch(tenant_id):
        raise TenantScopeError(f"invalid tenant id {tenant_id!r}")
    return tenant_id


def hash_key(secret: str) -> str:
    # API keys are 256-bit random tokens, so a fast hash is safe here (no dictionary to attack);
    # it keeps authentication one indexed lookup.
    return hashlib.sha256(secret.encode()).hexdigest()


class Backend(ABC):
    dialect: str
    #: A zero-retention agent's store: in memory, never on disk (``EphemeralBackend``).
    ephemeral = False

    # -- transactions -------------------------------------------------------------------------

    @abstractmethod
    def tenant_tx(self, tenant_id: str, *, write: bool = True) -> contextlib.AbstractContextManager[Conn]:
        """A transaction that can see and change only ``tenant_id``'s rows."""

    def tenant_read(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """One read-only statement on ``tenant_id``'s rows; backends may run it without an explicit transaction."""
        with self.tenant_tx(tenant_id, write=False) as c:
            return c.q(sql, params)

    def tenant_call(self, tenant_id: str, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run one statement on ``tenant_id``'s rows as its own transaction and return its rows: committed
        when this returns, rolled back if it raises.

        SQLite: the tenant's file is the scope; ``params`` are bound as given. PostgreSQL: the statement
        must scope itself (``moorage_lg_write`` sets ``moorage.tenant_id`` from its first argument), so it
        receives ``tenant_id`` as its first parameter, then ``params``.
        """
        with self.tenant_tx(tenant_id) as c:
            return c.q(sql, params)

    @abstractmethod
    def control_tx(self) -> contextlib.AbstractContextManager[Conn]:
        """A transaction on the control plane (tenants, API keys): operator use only."""

    @abstractmethod
    def authenticate_hash(self, key_hash: str) -> tuple[str, str, str, float | None] | None:
        """(key id, tenant id, scopes csv, revoked_at) for a key hash, or None."""

    @abstractmethod
    def init_tenant(self, tenant_id: str) -> None:
        """Prepare storage for a new tenant (SQLite: its own migrated file)."""

    @abstractmethod
    def drop_tenant(self, tenant_id: str) -> None:
        """Remove every row and file of a tenant."""

    @abstractmethod
    def schema_version(self, tenant_id: str | None = None) -> int: ...

    def purge(self, tenant_id: str) -> None:
        """Make deletions physical where the backend can (called after forgetting a user)."""

    def blob_log(self, tenant_id: str) -> "BlobLog | None":
        """Where this tenant's large LangGraph channel values go instead of a table, or None (kept in rows)."""
        return None

    def vacuum_blobs(self, tenant_id: str) -> tuple[int, int]:
        """Reclaim blob-log space no row refers to; (segments removed, bytes punched)."""
        return 0, 0

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def close(self) -> None: ...

    # -- control plane: shared SQL ------------------------------------------------------------

    def ping(self) -> None:
        """One round trip to the control plane: raises (``StoreUnreachable`` on PostgreSQL) when it cannot answer."""
        with self.control_tx() as c:
            c.one("SELECT 1")

    def create_tenant(self, name: str) -> Tenant:
        check_id(name, "tenant name")
        t = Tenant(uuid.uuid4().hex, name, time.time(), 1)
        with self.control_tx() as c:
            if c.one("SELECT 1 FROM tenants WHERE name = ?", (name,)):
                from moorage.errors import ConflictError

                raise ConflictError(f"a tenant named {name!r} already exists")
            c.x("INSERT INTO tenants (id, name, created_at, version) VALUES (?, ?, ?, 1)", (t.id, name, t.created_at))
        self.init_tenant(t.id)
        return t

    def get_tenant(self, name_or_id: str) -> Tenant:
        with self.control_tx() as c:
            r = c.one(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE id = ? OR name = ?", (name_or_id, name_or_id))
        if r is None:
            raise NotFound(f"no tenant {name_or_id!r}", hint="`moorage store tenants` lists them; create one with "
                                                               "`moorage store create-tenant NAME`")
        return Tenant(*r)

    def tenant_limits(self, tenant_id: str) -> dict[str, Any]:
        """The operator's limits of one tenant (``{}``: the installation's defaults; store/schema.py control 4)."""
        with self.control_tx() as c:
            r = c.one("SELECT limits FROM tenants WHERE id = ?", (tenant_id,))
        limits = json.loads(r[0]) if r is not None and r[0] else {}
        return limits if isinstance(limits, dict) else {}

    def set_tenant_limits(self, name_or_id: str, limits: dict[str, Any]) -> Tenant:
        """Replace the operator's limits of one tenant (by its name or id)."""
        t = self.get_tenant(name_or_id)
        with self.control_tx() as c:
            c.x("UPDATE tenants SET limits = ? WHERE id = ?", (json.dumps(limits, sort_keys=True), t.id))
        return t

    def list_tenants(self) -> list[Tenant]:
        with self.control_tx() as c:
            return [Tenant(*r) for r in c.q(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")]

    def mark_tenant_deleting(self, tenant_id: str) -> Tenant:
        """Record that the tenant's deletion began (kept from the first mark: a delete sent again finishes it)."""
        with self.control_tx() as c:
            c.x("UPDATE tenants SET deleting_since = COALESCE(deleting_since, ?) WHERE id = ?", (time.time(), tenant_id))
        return self.get_tenant(tenant_id)

    def delete_tenant(self, tenant_id: str) -> None:
        check_tenant_id(tenant_id)
        self.drop_tenant(tenant_id)
        with self.control_tx() as c:
            c.x("DELETE FROM api_keys WHERE tenant_id = ?", (tenant_id,))
            c.x("DELETE FROM tenants WHERE id = ?", (tenant_id,))

    def create_api_key(self, tenant_id: str, scopes: Sequence[str], label: str = "", agent: str | None = None) -> ApiKey:
        from moorage.store.repos.keys import _check_scopes

        sc = _check_scopes(scopes)
        if agent is not None:
            check_id(agent, "agent name")
        if not isinstance(label, str) or len(label) > 200:
            raise InvalidInput("key label must be a string of at most 200 characters")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(uuid.uuid4().hex[:16], tenant_id, sc, label, time.time(), None, secret, agent)
        stored = ",".join(sorted(sc)) + ("" if agent is None else f",{AGENT_SCOPE_PREFIX}{agent}")
        with self.control_tx() as c:
            tenant = c.one("SELECT deleting_since FROM tenants WHERE id = ?", (tenant_id,))
            if not tenant:
                raise NotFound(f"no tenant {tenant_id!r}")
            if tenant[0] is not None:
                from moorage.errors import ConflictError

                raise ConflictError(f"tenant {tenant_id!r} is being deleted", hint="its keys were revoked with it")
            c.x(
                "INSERT INTO api_keys (id, tenant_id, key_hash, scopes, label, created_at, revoked_at) VALUES (?, ?, ?, ?, ?, ?, NULL)",
                (key.id, tenant_id, hash_key(secret), stored, label, key.created_at),
            )
        return key

    def list_api_keys(self, tenant_id: str) -> list[ApiKey]:
        with self.control_tx() as c:
            rows = c.q("SELECT id, tenant_id, scopes, label, created_at, revoked_at FROM api_keys WHERE tenant_id = ? ORDER BY created_at", (tenant_id,))
        out = []
        for r in rows:
            scopes, agent = split_scopes(r[2])
            out.append(ApiKey(r[0], r[1], scopes, r[3], r[4], r[5], agent=agent))
        return out

    def key_revocations(self, tenant_id: str, key_ids: Collection[str]) -> dict[str, float | None]:
        """For each of ``key_ids`` that is a key of the tenant: when it was revoked (None: it was not). Looked up
        by id, so checking the keys of an end-user token or of work under way costs the same however many keys
        the tenant has (before, each such check listed them all)."""
        ids, out = sorted(set(key_ids)), {}
        with self.control_tx() as c:
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                rows = c.q(f"SELECT id, revoked_at FROM api_keys WHERE tenant_id = ? AND id IN "
                           f"({', '.join('?' * len(part))})", (tenant_id, *part))
                out.update({r[0]: r[1] for r in rows})
        return out

    def revoke_api_key(self, tenant_id: str, key_id: str) -> None:
        with self.control_tx() as c:
            n = c.x("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND tenant_id = ? AND revoked_at IS NULL", (time.time(), key_id, tenant_id))
        if n != 1:
            raise NotFound(f"no active key {key_id!r}")


@contextlib.contextmanager
def translate_integrity(is_integrity: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[None]:
    """Turn a backend's unique-constraint failure into the typed ``ConflictError`` callers expect."""
    from moorage.errors import ConflictError

    try:
        yield
    except is_integrity as e:
        raise ConflictError(f"a concurrent writer created the same record first ({str(e).splitlines()[0]})") from e


class StoreContention(UnavailableError):
    """The store aborted a transaction to break a deadlock with a concurrent one, or to keep transactions
    serializable (PostgreSQL's 40P01 and 40001): nothing of it was kept, and the same call may run again."""

    retry_after = 1.0


@contextlib.contextmanager
def translate_contention(is_contention: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[None]:
    """Turn a backend's deadlock or serialization failure into the typed, retryable ``StoreContention``."""
    try:
        yield
    except is_contention as e:
        raise StoreContention(f"the store aborted this change to break a conflict with a concurrent one "
                              f"({str(e).splitlines()[0]})", hint="retry the request: nothing of it was kept") from e
