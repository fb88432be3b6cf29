"""Three `moorage up` processes, one PostgreSQL database and one S3 server (SeaweedFS): a fleet on one machine.

Each host has its own data directory and port, as separate machines would; the process driver keeps the suite
fast (the fleet's logic does not depend on the driver; tests/fleet/test_microvm_fleet.py runs micro-VMs).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost, fleet_env, write_counter_agent
from moorage.store import open_store


def until(cond: Callable[[], Any], what: str, timeout_s: float = 90.0, every_s: float = 0.5) -> None:
    """Wait for ``cond()`` to hold (the fleet's background work: collections, prefetch, takeovers); fail naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"still not true after {timeout_s:.0f} s: {what}"
        time.sleep(every_s)


def replied(r: httpx.Response) -> str:
    """A turn's reply, the turn checked to have succeeded."""
    assert r.status_code == 200, r.text
    return r.json()["reply"]


def put_to_sleep(f: "Fleet", user: str, via: int = 0) -> None:
    """Put ``user``'s instance to sleep through host ``via``."""
    sid = f.records()[user].id
    r = f.api[via].post(f"/v1/sandboxes/{sid}/sleep")
    assert r.status_code == 200 and r.json()["slept"] is True, r.text


class Fleet:
    def __init__(self, base: Path, store_url: str, s3: dict[str, str], n: int = 3, **settings: str) -> None:
        self.base, self.store_url = base, store_url
        self.env = fleet_env(store_url, s3, lease_ttl_s="4", heartbeat_s="1", **settings)
        self.hosts: list[LocalHost] = []
        self.api: list[httpx.Client] = []
        self.key = ""  # the first host's local admin key
        for _ in range(n):
            self.add_host()

    def add_host(self, host_url: str | None = None, environ: dict[str, str] | None = None, **settings: str) -> int:
        """Start one more host (a machine joining the fleet), with ``settings`` (MOORAGE_*) and ``environ`` (other
        variables) on top, registered at ``host_url`` where not at its own port; its index."""
        name = f"h{len(self.hosts) + 1}"
        env = {**self.env, **(environ or {}), **{f"MOORAGE_{k.upper()}": v for k, v in settings.items()}}
        self.hosts.append(LocalHost(name, self.base / name, env, start_timeout_s=120, host_url=host_url))
        self.key = self.key or self.hosts[0].key
        self.api.append(self.hosts[-1].client(self.key))
        return len(self.hosts) - 1

    def deploy(self) -> None:
        r = self.api[0].post("/v1/agents/echo/deployments", content=tar_dir(write_counter_agent(self.base)),
                             headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    def deploy_agent(self, name: str, agent_py: str, toml: str = "") -> None:
        """Deploy ``agent_py`` as agent ``name`` (users made as they come, awake for an hour) through the first
        host; ``toml`` adds to its ``[agent]`` table (``ports = [8080]``)."""
        d = self.base / f"agent-{name}"
        d.mkdir(exist_ok=True)
        (d / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n{toml}'
                                        '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
        (d / "agent.py").write_text(agent_py)
        r = self.api[0].post(f"/v1/agents/{name}/deployments", content=tar_dir(d),
                             headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    def turn(self, i: int, user: str, text: str = "hi") -> httpx.Response:
        return self.api[i].post("/v1/agents/echo/invoke", json={"message": text, "user": user})

    def records(self) -> dict[str, Any]:
        store = open_store(Config(store_url=self.store_url))
        try:
            return {r.scope.user: r for ts in store.operator.tenants() for r in ts.sandboxes.list(limit=10000)}
        finally:
            store.close()

    def live_deployment(self, agent: str = "echo") -> str:
        store = open_store(Config(store_url=self.store_url))
        try:
            (ts,) = list(store.operator.tenants())
            return ts.agents.get(agent).live_deployment
        finally:
            store.close()

    def host_rows(self) -> list[Any]:
        from moorage.fleet.hosts import HostRegistry

        store = open_store(Config(store_url=self.store_url))
        try:
            return HostRegistry(store.backend).list()
        finally:
            store.close()

    def spans(self, name: str) -> list[Any]:
        store = open_store(Config(store_url=self.store_url))
        try:
            return [s for ts in store.operator.tenants() for s in ts.spans.recent(limit=100000) if s.name == name]
        finally:
            store.close()

    def close(self) -> None:
        for c in self.api:
            c.close()
        for h in self.hosts:
            h.stop()


class Relay:
    """A TCP relay in front of a real server (the S3 server): ``close()`` is that server going down for the hosts
    that reach it through here (connections refused, open ones cut), ``open()`` brings it back on the same port."""

    def __init__(self, target_port: int) -> None:
        from moorage.devservices.postgres import free_port

        self.target, self.port = target_port, free_port()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._srv: socket.socket | None = None
        self.open()

    def open(self) -> None:
        if self._srv is not None:
            return
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(128)
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def close(self) -> None:
        if self._srv is not None:
            with contextlib.suppress(OSError):
                self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept
            self._srv.close()
            self._srv = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                down, _ = srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                down.close()
                continue
            with self._lock:
                self._conns |= {down, up}
            for a, b, upstream in ((down, up, True), (up, down, False)):
                threading.Thread(target=self._pipe, args=(a, b, upstream), daemon=True).start()

    def passing(self, data: bytes, upstream: bool) -> None:
        """Called with each chunk before it is sent on (``upstream``: the client's, towards the server); a test's
        relay may hold it here."""

    def _pipe(self, a: socket.socket, b: socket.socket, upstream: bool) -> None:
        try:
            while data := a.recv(65536):
                self.passing(data, upstream)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns -= {a, b}
            a.close()


def relayed_fleet(base: Path, store_url: str, seaweedfs: Any, s3_bucket: str, relay: "Relay", *,
                  n: int = 3, **settings: str) -> Iterator[Fleet]:
    """A deployed fleet whose object store is reached through ``relay`` (so a test can take it down); the relay is
    opened again before the hosts stop. For a module-scoped fixture: ``yield from relayed_fleet(...)``."""
    s3 = {**seaweedfs.settings(s3_bucket, f"fleet-{base.name}"), "object_store_endpoint": f"http://127.0.0.1:{relay.port}"}
    f = Fleet(base, store_url, s3, n=n, **settings)
    try:
        f.deploy()
        yield f
    finally:
        relay.open()
        f.close()
