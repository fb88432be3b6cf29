"""The PostgreSQL backend while its server restarts, is stopped or has its connections cut (real server, pg_ctl):
the next call after the server is back works, and a call while it is down is a prompt, retryable 503."""

from __future__ import annotations

import itertools
import time
from typing import Iterator

import pytest

from moorage.errors import UnavailableError
from moorage.store import Scope, Store
from moorage.store.postgres import PostgresBackend
from tests.outage.conftest import Outages

_dbs = itertools.count()
S = Scope.session("bot", "alice", "s1")


@pytest.fixture
def store(outages: Outages) -> Iterator[tuple[Store, str]]:
    name = f"b{next(_dbs)}"
    s = Store(PostgresBackend(outages.cluster.create_database(name)))
    yield s, name
    s.close()


def _use(s: Store, key: str) -> int:
    """One call of each kind: a control-plane transaction, a key check, a tenant write and a tenant read; returns
    how many events the tenant has."""
    t = s.backend.get_tenant("acme")
    assert len(s.backend.list_api_keys(t.id)) == 1
    ts = s.tenant(s.authenticate(key))
    ts.events.append(S, "message", "hello")
    return len(ts.events.list(S, limit=1000))


def _setup(s: Store) -> str:
    _, key = s.operator.create_tenant("acme")
    return key.secret


@pytest.mark.parametrize("cut", ["restart", "terminate"])
def test_every_call_after_a_restart_or_cut_connections_works_on_its_first_try(store, outages: Outages,
                                                                              cut: str) -> None:
    s, db = store
    key = _setup(s)
    assert _use(s, key) == 1
    if cut == "restart":
        outages.restart()
    else:
        assert outages.terminate(db) >= 2  # the owner's connection and the pool's
    assert _use(s, key) == 2  # no call fails: connections the server closed are replaced before use
    assert _use(s, key) == 3


def test_a_call_while_the_server_is_down_is_a_prompt_503_and_the_next_one_after_it_is_back_works(
        store, outages: Outages) -> None:
    s, _ = store
    key = _setup(s)
    assert _use(s, key) == 1
    outages.stop()
    try:
        for call in (lambda: s.backend.tenant_read(s.backend.get_tenant("acme").id, "SELECT 1"),
                     lambda: s.authenticate(key),
                     lambda: s.backend.list_tenants()):
            t0 = time.monotonic()
            with pytest.raises(UnavailableError) as e:
                call()
            assert time.monotonic() - t0 < 8, "the call waited past the connection wait"
            assert e.value.http_status == 503 and getattr(e.value, "retry_after", 0) > 0
            assert "cannot reach PostgreSQL" in e.value.message and "reconnects by itself" in (e.value.hint or "")
        time.sleep(8)  # longer than the pool keeps retrying in the background
    finally:
        outages.start()
    t0 = time.monotonic()
    assert _use(s, key) == 2  # nothing was written meanwhile, nothing was lost
    assert time.monotonic() - t0 < 3, "the pool waited out a back-off after the server was back"


def test_a_write_while_postgresql_takes_no_writes_is_a_503_and_works_once_it_does_again(store, outages: Outages) -> None:
    """A failover in progress (or a pooler still pointing at the old primary, now a standby): the server answers, but
    read-only. Writes are a retryable 503, not a 500, and work on the next try once it takes writes again."""
    s, db = store
    key = _setup(s)
    assert _use(s, key) == 1
    outages.cluster.psql(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
    outages.terminate(db)  # its sessions reconnect read-only, as to a standby
    try:
        tenant_id = s.backend.get_tenant("acme").id
        for write in (lambda: s.tenant(s.authenticate(key)).events.append(S, "message", "while read-only"),
                      lambda: s.backend.create_api_key(tenant_id, ["read"])):
            with pytest.raises(UnavailableError) as e:
                write()
            assert e.value.http_status == 503 and "takes no writes" in e.value.message, e.value
    finally:
        outages.cluster.psql(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
    assert _use(s, key) == 2                                     # the read-only connections were not kept
    s.backend.create_api_key(tenant_id, ["read"])


def test_a_healthy_connection_past_descriptor_1024_is_not_taken_for_a_closed_one(outages: Outages) -> None:
    """A busy host (sandboxes, sockets) has more than 1024 descriptors open: the check for a connection the server
    closed must not mistake every later one for closed (each request would then connect anew)."""
    import os
    import resource

    import psycopg

    from moorage.store.pg_outage import stale

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        conn = psycopg.connect(outages.cluster.superuser_url, autocommit=True)
        try:
            assert conn.fileno() > 1024
            assert not stale(conn)
            outages.terminate("postgres")
            time.sleep(0.5)
            assert stale(conn)                                       # and one the server closed still is
        finally:
            conn.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
