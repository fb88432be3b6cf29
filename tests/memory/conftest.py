"""Fixtures for memory tests: the real store on both backends (SQLite files, PostgreSQL with RLS)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

import pytest

from moorage.config import Config
from moorage.memory.embeddings import Embedder, default_embedder
from moorage.store import Store, TenantStore, open_store

_db_names = itertools.count()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[object]:
    from moorage.devservices.postgres import start_cluster

    cluster = start_cluster(max_connections=100)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def memory_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh store on each backend. PostgreSQL gets a new database per test inside one cluster."""
    if request.param == "sqlite":
        store = open_store(Config(data_dir=tmp_path))
    else:
        cluster = request.getfixturevalue("pg_cluster")
        url = cluster.create_database(f"mem{next(_db_names)}")
        store = open_store(Config(data_dir=tmp_path, store_url=url, store_app_role="moorage_app"))
    try:
        yield store
    finally:
        store.close()


def tenant(store: Store, name: str) -> TenantStore:
    t, _ = store.operator.create_tenant(name)
    return store.tenant(store.operator.principal(t.id))


@pytest.fixture
def tenant_a(memory_store: Store) -> TenantStore:
    return tenant(memory_store, "acme")


@pytest.fixture
def tenant_b(memory_store: Store) -> TenantStore:
    return tenant(memory_store, "globex")


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return default_embedder()
