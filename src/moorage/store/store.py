"""The store's front door: authenticate a key into a ``Principal``, then get a tenant-scoped handle.

Operator actions (creating tenants, sweeping every tenant) are on ``Store.operator``, kept apart from
the request path so that a request can only ever reach the tenant its credentials name.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from moorage.errors import InvalidInput, Unauthenticated
from moorage.store.base import KEY_PREFIX, Backend, hash_key
from moorage.store.model import ApiKey, Principal, Tenant, split_scopes
from moorage.store.sqlite import EphemeralBackend
from moorage.store.tenant import SweepReport, TenantStore


class Operator:
    """Control-plane actions for whoever runs the moorage installation (CLI, internal jobs)."""

    def __init__(self, store: "Store") -> None:
        self._store = store

    def create_tenant(self, name: str) -> tuple[Tenant, ApiKey]:
        """Create a tenant and its first admin key (the secret is only returned here)."""
        b = self._store.backend
        t = b.create_tenant(name)
        return t, b.create_api_key(t.id, ["admin"], "initial admin key")

    def list_tenants(self) -> list[Tenant]:
        return self._store.backend.list_tenants()

    def get_tenant(self, name_or_id: str) -> Tenant:
        return self._store.backend.get_tenant(name_or_id)

    def delete_tenant(self, tenant_id: str) -> None:
        self._store.backend.delete_tenant(tenant_id)

    def tenant_limits(self, name_or_id: str) -> dict[str, Any]:
        """The operator's limits of one tenant (``{}``: the installation's defaults for every tenant)."""
        return self._store.backend.tenant_limits(self._store.backend.get_tenant(name_or_id).id)

    def set_tenant_limits(self, name_or_id: str, *, storage_mib: float | None) -> dict[str, Any]:
        """Set (a number, 0: no ceiling) or clear (None: the installation's ``tenant_max_storage_mib``) one tenant's
        own ``storage_mib`` ceiling; returns its limits as they now are. A running host applies it within a minute
        (usage/tenant_cap.py)."""
        if storage_mib is not None and (isinstance(storage_mib, bool) or not isinstance(storage_mib, (int, float))
                                        or not 0 <= storage_mib < float("inf")):
            raise InvalidInput(f"storage_mib must be a number of MiB, 0 or more (0: no ceiling), not {storage_mib!r}")
        b = self._store.backend
        t = b.get_tenant(name_or_id)
        limits = b.tenant_limits(t.id)
        if storage_mib is None:
            limits.pop("storage_mib", None)
        else:
            limits["storage_mib"] = float(storage_mib)
        b.set_tenant_limits(t.id, limits)
        return limits

    def principal(self, tenant_id: str) -> Principal:
        """A principal for moorage's own jobs on one tenant (sweeper, lifecycle), never built from request data."""
        self._store.backend.get_tenant(tenant_id)
        return Principal(tenant_id, frozenset({"admin"}), key_id="system")

    def tenants(self) -> Iterator[TenantStore]:
        for t in self.list_tenants():
            yield self._store.tenant(self.principal(t.id))

    def sweep_all(self, now: float | None = None) -> SweepReport:
        scopes = rows = 0
        for ts in self.tenants():
            r = ts.sweep(now)
            scopes += r.scopes
            rows += r.rows
        return SweepReport(scopes, rows)


class Store:
    def __init__(self, backend: Backend, max_value_bytes: int = 1 << 20) -> None:
        self.backend = backend
        self.max_value_bytes = max_value_bytes
        self.operator = Operator(self)

    def authenticate(self, secret: str) -> Principal:
        """Map an API key to its principal. The tenant id comes from here and nowhere else."""
        if not isinstance(secret, str) or not secret.startswith(KEY_PREFIX) or len(secret) > 200:
            raise Unauthenticated("missing or malformed API key", hint="send `Authorization: Bearer mrg_...`")
        row = self.backend.authenticate_hash(hash_key(secret))
        if row is None or (row[3] is not None and row[3] <= time.time()):
            raise Unauthenticated("unknown or revoked API key")
        scopes, agent = split_scopes(row[2])
        return Principal(row[1], scopes, key_id=row[0], agent=agent)

    def tenant(self, principal: Principal) -> TenantStore:
        if not isinstance(principal, Principal):
            raise TypeError("Store.tenant needs a Principal from Store.authenticate or Store.operator.principal")
        return TenantStore(self.backend, principal, self.max_value_bytes)

    def ephemeral(self, principal: Principal) -> TenantStore:
        """A zero-retention handle for a stateless agent: same API, kept in memory, never written to disk."""
        return TenantStore(EphemeralBackend(principal.tenant_id), principal, self.max_value_bytes)

    def ping(self) -> None:
        """Whether the store answers now: returns, or raises what its backend raised (a readiness check's)."""
        self.backend.ping()

    def describe(self) -> str:
        return self.backend.describe()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
