"""moorage's durable store: the source of truth for every agent's continuity.

``open_store(config)`` returns a ``Store``; ``store.tenant(principal)`` a ``TenantStore`` handle.
"""

from __future__ import annotations

from moorage.config import Config
from moorage.errors import ConfigError
from moorage.store.base import Backend
from moorage.store.model import (
    DEPLOYMENT_BUILDING,
    DEPLOYMENT_DELETED,
    DEPLOYMENT_FAILED,
    DEPLOYMENT_READY,
    FORKED_FROM,
    SHARED_TEMPLATE,
    Agent,
    ApiKey,
    Deployment,
    EndUser,
    EntityKey,
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
    Tenant,
    UsageEntry,
    WorkflowRun,
)
from moorage.store.repos.events import EventIn
from moorage.store.store import Operator, Store
from moorage.store.tenant import SweepReport, TenantStore


def open_backend(config: Config) -> Backend:
    url = config.store_url
    if url in ("sqlite", "") or url.startswith("sqlite:"):
        from moorage.store.sqlite import SQLiteBackend

        path = url.removeprefix("sqlite:").removeprefix("//") if url.startswith("sqlite:") else ""
        return SQLiteBackend(path or (config.data_dir / "store"))
    if url.startswith(("postgresql://", "postgres://")):
        from moorage.store.postgres import PostgresBackend

        return PostgresBackend(url, config.store_app_role, config.store_app_url or None)
    raise ConfigError(f"unsupported store URL {url!r}", hint="use 'sqlite' (default) or a postgresql:// URL")


def open_store(config: Config) -> Store:
    return Store(open_backend(config), config.max_value_bytes)


__all__ = [
    "Agent", "ApiKey", "Backend", "Deployment", "EndUser", "EntityKey", "Event", "EventIn", "Fact", "JournalEntry",
    "Operator", "Principal", "Record", "SandboxRecord", "Scope", "Session", "Span", "Step", "Store", "SweepReport",
    "Tenant", "TenantStore", "UsageEntry", "WorkflowRun", "open_backend", "open_store",
    "FORKED_FROM", "SHARED_TEMPLATE", "DEPLOYMENT_BUILDING", "DEPLOYMENT_READY", "DEPLOYMENT_FAILED", "DEPLOYMENT_DELETED",
]
