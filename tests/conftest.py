"""Fixtures shared by the whole suite: real services (a throwaway PostgreSQL cluster) and stores.

Nothing here skips: CI sets MOORAGE_TEST_STRICT=1 and a missing service is an error.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Iterator

import pytest

from moorage.config import Config
from moorage.devservices.postgres import PostgresCluster, start_cluster
from moorage.store import Principal, Store, TenantStore
from moorage.store.postgres import PostgresBackend
from moorage.store.sqlite import SQLiteBackend

STORE_BACKENDS = ("sqlite", "postgres")
_db_counter = itertools.count()


@pytest.fixture(autouse=True)
def _moorage_logging_as_found() -> Iterator[None]:
    """A CLI command run in-process configures moorage's logger (info, on stderr): undone after its test, so the
    rest of the worker does not print info lines outside any test's captured output."""
    logger = logging.getLogger("moorage")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.level, logger.propagate = saved[1], saved[2]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    cluster = start_cluster()
    yield cluster
    cluster.stop(remove_after=True)  # the run's hundreds of databases: removed after the run, not within it


@pytest.fixture
def pg_url(pg_cluster: PostgresCluster) -> str:
    """Owner URL of a fresh, empty database for this test."""
    return pg_cluster.create_database(f"t{next(_db_counter)}")


def make_backend(kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    if kind == "sqlite":
        return SQLiteBackend(tmp_path / "store")
    return PostgresBackend(request.getfixturevalue("pg_url"))


@pytest.fixture(params=STORE_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh store on each backend (SQLite files in tmp_path; a new PostgreSQL database)."""
    s = Store(make_backend(request.param, tmp_path, request), max_value_bytes=64 * 1024)
    yield s
    s.close()


@pytest.fixture
def tenant(store: Store) -> TenantStore:
    _, key = store.operator.create_tenant("acme")
    return store.tenant(store.authenticate(key.secret))


@pytest.fixture
def other_tenant(store: Store) -> TenantStore:
    _, key = store.operator.create_tenant("globex")
    return store.tenant(store.authenticate(key.secret))


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config(data_dir=tmp_path / "data")


def system_principal(store: Store, tenant_id: str) -> Principal:
    return store.operator.principal(tenant_id)


async def stop_all_sandboxes(driver) -> None:  # type: ignore[no-untyped-def]
    """Test teardown: stop every sandbox a test left running (a host's close() only detaches from them)."""
    import contextlib

    for sid in await driver.list():
        with contextlib.suppress(Exception):
            sb = await driver.open(sid)
            if sb.state.value == "running":
                await sb.stop()


@pytest.fixture(scope="session", autouse=True)
def _reap_leftover_guests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Safety net: at the end of the run, stop any QEMU or bubblewrap guest whose files live under this run's
    temporary directory (a test that failed half-way may not have reached its own teardown)."""
    yield
    import os
    import signal

    base = str(tmp_path_factory.getbasetemp())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        exe = os.path.basename(argv[0].decode(errors="replace")) if argv and argv[0] else ""
        if exe.startswith(("qemu-system", "bwrap")) and any(base.encode() in a for a in argv):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def unspelled(text: str) -> str:
    """A grep (basic regex) pattern that matches ``text`` without containing it: one character goes in brackets.
    A test that searches a sandbox for a secret must not send the secret in, when it then scans the sandbox's
    memory (the pattern passes through the supervisor, and freed memory may still hold it)."""
    special = set(".[]*^$\\")
    i = next(k for k in range(len(text) // 2, len(text)) if text[k].isalnum())
    esc = ["\\" + c if c in special else c for c in text]
    esc[i] = f"[{text[i]}]"
    return "".join(esc)
