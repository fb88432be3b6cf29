"""Fixtures for the durable tests: a store URL on each backend and a "host" that can be restarted.

A restart closes the store and opens a new one on the same database, as a new host process would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from moorage.config import Config
from moorage.store import Store, TenantStore, open_store


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'store'}"
    return request.getfixturevalue("pg_url")


class Host:
    """One tenant on one database, reopened from scratch by ``restart()``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stores: list[Store] = []
        admin = self._open()
        _, key = admin.operator.create_tenant("durable")
        self.key = key.secret
        self.ts = self.restart()

    def _open(self) -> Store:
        s = open_store(Config(store_url=self.url))
        self._stores.append(s)
        return s

    def restart(self) -> TenantStore:
        """Drop every open handle and return a tenant handle on a freshly opened store."""
        for s in self._stores:
            s.close()
        self._stores.clear()
        s = self._open()
        self.ts = s.tenant(s.authenticate(self.key))
        return self.ts

    def second(self) -> TenantStore:
        """Another, independent handle on the same tenant (another process, in effect)."""
        s = self._open()
        return s.tenant(s.authenticate(self.key))

    def close(self) -> None:
        for s in self._stores:
            s.close()


@pytest.fixture
def host(store_url: str) -> Iterator[Host]:
    h = Host(store_url)
    yield h
    h.close()
