"""The PostgreSQL backend cut off from its server by a network partition (real server in a network namespace,
reached over a veth pair whose far end is taken down): a call fails as a 503 within seconds instead of waiting out
TCP's retransmissions (about 15 minutes), and the backend serves again once the network is back. The TCP
settings that do it give way to the store URL's own."""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from moorage.devservices.postgres import _bindir
from moorage.errors import UnavailableError
from moorage.store import Scope, Store
from moorage.store.postgres import PostgresBackend
from tests.outage.conftest import Outages

NS = f"moorage-part-{os.getpid()}"
HOST_IF, NS_IF = f"mpa{os.getpid() % 100000}", f"mpb{os.getpid() % 100000}"
HOST_IP, SERVER_IP = "10.231.77.1", "10.231.77.2"
PORT = 5432
S = Scope.session("bot", "alice", "s1")


def _sh(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr.strip()}"


class PartitionedServer:
    """A PostgreSQL cluster whose postmaster runs in network namespace ``NS``, listening on ``SERVER_IP`` only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bindir = _bindir()
        self.as_postgres = ["runuser", "-u", "postgres", "--"]

    def psql(self, sql: str) -> str:
        # Over the Unix socket: a file, reachable from every network namespace.
        r = subprocess.run([str(self.bindir / "psql"), "-h", str(self.root), "-p", str(PORT), "-U", "postgres",
                            "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-Atq", "-c", sql],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def cut(self) -> None:
        """Silently drop every packet between the host and the server (no reset, no ICMP): the far end goes down."""
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "down")

    def mend(self) -> None:
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")


@pytest.fixture
def server() -> Iterator[PartitionedServer]:
    pw = pwd.getpwnam("postgres")
    root = Path(tempfile.mkdtemp(prefix="moorage-pg-part-"))
    os.chown(root, pw.pw_uid, pw.pw_gid)
    srv = PartitionedServer(root)
    data = root / "data"
    try:
        _sh("ip", "netns", "add", NS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{SERVER_IP}/30", "dev", NS_IF)
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        _sh(*srv.as_postgres, str(srv.bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
            "--no-sync", "-E", "UTF8", "--locale=C.UTF-8")
        with open(data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {HOST_IP}/32 trust\n")
        opts = f"-p {PORT} -k {root} -c listen_addresses={SERVER_IP} -c max_connections=50 -c fsync=off"
        _sh("ip", "netns", "exec", NS, *srv.as_postgres, str(srv.bindir / "pg_ctl"), "-D", str(data), "-l",
            str(root / "log"), "-o", opts, "-w", "-t", "60", "start")
        srv.psql("CREATE ROLE moorage_owner LOGIN CREATEROLE NOSUPERUSER NOBYPASSRLS")
        srv.psql("CREATE DATABASE moorage OWNER moorage_owner")
        yield srv
    finally:
        subprocess.run([*srv.as_postgres, str(srv.bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)  # daemon: on a failure it may hang for minutes
    t.start()
    return t, out


def _hold(backend: PostgresBackend, tenant_id: str) -> None:
    with backend.tenant_tx(tenant_id, write=False) as c:
        c.raw.execute("SELECT pg_sleep(1)")


def test_a_call_cut_off_by_a_partition_is_a_503_within_seconds_and_the_backend_serves_again_after(
        server: PartitionedServer) -> None:
    s = Store(PostgresBackend(f"postgresql://moorage_owner@{SERVER_IP}:{PORT}/moorage"))
    try:
        _, key = s.operator.create_tenant("acme")
        ts = s.tenant(s.authenticate(key.secret))
        ts.events.append(S, "message", "before")
        tenant_id = s.backend.get_tenant("acme").id
        # Three transactions at once: the pool holds three open connections, which the partition leaves idle.
        held = [_in_thread(functools.partial(_hold, s.backend, tenant_id)) for _ in range(3)]
        for t, out in held:
            t.join(30)
            assert "error" not in out, out
        server.cut()
        try:
            calls = {"write": lambda: ts.events.append(S, "message", "during"),
                     "read": lambda: s.backend.tenant_read(tenant_id, "SELECT count(*) FROM events"),
                     "control plane": lambda: s.backend.list_tenants()}
            running = {name: _in_thread(call) for name, call in calls.items()}
            for name, (t, out) in running.items():
                t.join(60)
                assert not t.is_alive(), f"the {name} still waits on the partitioned server after 60 s"
                e = out.get("error")
                assert isinstance(e, UnavailableError), f"the {name}: {out}"
                assert e.http_status == 503 and getattr(e, "retry_after", 0) > 0
                assert "cannot reach PostgreSQL" in e.message, e.message
                assert out["took"] < 40, f"the {name} took {out['took']:.0f} s to fail"
        finally:
            server.mend()
        deadline = time.monotonic() + 30
        while True:  # the first call may still meet a connection attempt begun during the partition
            try:
                ts.events.append(S, "message", "after")
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert [e.content for e in ts.events.list(S, limit=10)] == ["before", "after"]
        assert s.backend.get_tenant("acme").id == tenant_id
    finally:
        s.close()


def test_the_store_urls_own_tcp_settings_win_over_the_hosts_defaults(outages: Outages) -> None:
    url = outages.cluster.create_database("tcpset") + "?keepalives_idle=30&tcp_user_timeout=45000"
    backend = PostgresBackend(url)
    try:
        with backend._pool.connection() as pooled:
            socks = [socket.socket(fileno=os.dup(c.fileno())) for c in (pooled, backend._owner)]
        for sock in socks:
            with sock:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30  # the URL's
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 45000  # the URL's
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5  # the host's default
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    finally:
        backend.close()
