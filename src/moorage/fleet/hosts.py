"""The fleet's host table: each host registers, heartbeats, drains and leaves; the table says who is alive.

A host's leases on instances are valid while its heartbeat is younger than the lease TTL: an instance recorded
awake on a host whose heartbeat is older may be taken over by any other host (with a new fencing epoch).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from moorage import clock
from moorage.errors import ConfigError, ConflictError, InvalidInput, NotFound
from moorage.store.base import Backend

#: active: serves and takes new instances; draining: finishing, takes none; gone: left cleanly.
HOST_STATES = ("active", "draining", "gone")
_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_COLS = "id, url, state, started_at, heartbeat_at, incarnation, load, version, secrets"


def check_host_id(host_id: object) -> str:
    if not isinstance(host_id, str) or not _HOST_ID.fullmatch(host_id):
        raise InvalidInput(f"malformed host id {host_id!r}",
                           hint="letters, digits, '.', '_' and '-', at most 128 (MOORAGE_HOST_ID)")
    return host_id


@dataclass(frozen=True)
class HostInfo:
    id: str
    url: str
    state: str
    started_at: float
    heartbeat_at: float
    #: Changes each time the host process starts: a restarted host is a new incarnation of the same id.
    incarnation: str
    load: dict[str, Any]
    version: int
    #: Fingerprints of the installation secrets it runs with (``fingerprints``): never the secrets.
    secrets: dict[str, Any] = field(default_factory=dict)

    def alive(self, ttl_s: float, now: float | None = None) -> bool:
        """Whether its heartbeat is younger than ``ttl_s`` on the store's clock (every host writes it on that clock,
        ``moorage.clock``, so hosts whose own clocks differ agree on it)."""
        return self.state != "gone" and (clock.now() if now is None else now) - self.heartbeat_at <= ttl_s


def _host(r: tuple) -> HostInfo:
    return HostInfo(r[0], r[1], r[2], float(r[3]), float(r[4]), r[5], json.loads(r[6] or "{}"), int(r[7]),
                    json.loads(r[8] or "{}"))


def _print(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(b"moorage-fleet-secret\0" + raw).hexdigest()[:16]


def fingerprints(token_secret: str, operator_token: str, secret_keys: list[tuple[str, bytes]]) -> dict[str, Any]:
    """What hosts compare to know they share the installation's secrets (docs/fleet.md), without showing them:
    short hashes of the end-user token secret and the operator token, and of each agent-secrets key (by id;
    the first one encrypts)."""
    return {"token-secret": _print(token_secret), "operator-token": _print(operator_token),
            "secrets-keys": {kid: _print(key) for kid, key in secret_keys},
            "secrets-primary": secret_keys[0][0] if secret_keys else None}


def check_shared(mine: dict[str, Any], other: HostInfo) -> str | None:
    """Why this host cannot serve beside ``other`` (a live host of the fleet), or None. Hosts that differ in the
    token secret or operator token refuse each other's credentials; a host must be able to read the agent
    secrets every other host writes (their first key), so a key is rotated by adding it everywhere first."""
    theirs = other.secrets
    if not theirs or not mine:
        return None  # a host from before these fingerprints: nothing to compare
    for name, what in (("token-secret", "end-user tokens"), ("operator-token", "operator requests")):
        if theirs.get(name) != mine.get(name):
            return (f"this host's <data_dir>/api/{name} differs from host {other.id}'s: {what} made on one "
                    "would be refused by the other")
    primary = theirs.get("secrets-primary")
    keys = mine.get("secrets-keys") or {}
    if primary and keys.get(primary) != (theirs.get("secrets-keys") or {}).get(primary):
        return (f"this host lacks the secrets key {primary!r} that host {other.id} encrypts agents' secrets with: "
                "it could not read them")
    return None


class HostRegistry:
    """Operator-plane access to the ``hosts`` table (not tenant data: no tenant scope applies)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def register(self, host_id: str, url: str, incarnation: str, secrets: dict[str, Any] | None = None, *,
                 ttl_s: float | None = None) -> HostInfo:
        """Insert or re-activate ``host_id`` at ``url``; a restart takes its old row over (same id). With
        ``secrets`` (``fingerprints``) and ``ttl_s``, a host whose secrets differ from a live host's is refused
        (``ConfigError``) before it serves anything."""
        check_host_id(host_id)
        if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/]+", url.rstrip("/")):
            raise InvalidInput(f"malformed host URL {url!r}", hint="the URL other hosts reach this one at, like http://10.0.0.5:8000")
        shared = json.dumps(secrets or {}, sort_keys=True)
        with self.backend.control_tx() as c:
            now = self._store_now(c)
            if secrets and ttl_s is not None:
                for other in (_host(r) for r in c.q(f"SELECT {_COLS} FROM hosts WHERE id != ?", (host_id,))):
                    why = check_shared(secrets, other) if other.alive(ttl_s, now) else None
                    if why is not None:
                        raise ConfigError(why, hint="copy the installation secrets from a running host before this "
                                                    "one starts (docs/fleet.md); to change one, stop every host first")
            if c.one("SELECT 1 FROM hosts WHERE id = ?", (host_id,)):
                c.x("UPDATE hosts SET url = ?, state = 'active', started_at = ?, heartbeat_at = ?, incarnation = ?, "
                    "load = '{}', secrets = ?, version = version + 1 WHERE id = ?",
                    (url.rstrip("/"), now, now, incarnation, shared, host_id))
            else:
                c.x(f"INSERT INTO hosts ({_COLS}) VALUES (?, ?, 'active', ?, ?, ?, '{{}}', 1, ?)",
                    (host_id, url.rstrip("/"), now, now, incarnation, shared))
        return self.get(host_id)

    def heartbeat(self, host_id: str, incarnation: str, load: dict[str, Any] | None = None) -> tuple[float, str]:
        """Renew the host's leases; returns (when, the host's state: an operator may have set ``draining``).
        ``ConflictError`` when another incarnation registered the same id since."""
        with self.backend.control_tx() as c:
            now = self._store_now(c)
            n = c.x("UPDATE hosts SET heartbeat_at = ?, load = ?, version = version + 1 "
                    "WHERE id = ? AND incarnation = ? AND state != 'gone'",
                    (now, json.dumps(load or {}, sort_keys=True), host_id, incarnation))
            row = c.one("SELECT state FROM hosts WHERE id = ?", (host_id,)) if n == 1 else None
        if row is None:
            raise ConflictError(f"host {host_id!r} was registered again by another process (or left)",
                                hint="two hosts must not share MOORAGE_HOST_ID")
        return now, row[0]

    def _store_now(self, c: Any) -> float:
        """The time on the store's clock, measured again (``moorage.clock``): a PostgreSQL server's clock is the
        fleet's, whatever this host's says. SQLite's is this machine's."""
        if self.backend.dialect == "postgres":
            sent = time.time()
            row = c.one("SELECT EXTRACT(EPOCH FROM clock_timestamp())")
            clock.observe(float(row[0]), sent, time.time())
        return clock.now()

    def set_state(self, host_id: str, state: str, incarnation: str | None = None) -> None:
        if state not in HOST_STATES:
            raise InvalidInput(f"unknown host state {state!r}", hint=f"one of {', '.join(HOST_STATES)}")
        with self.backend.control_tx() as c:
            sql, params = "UPDATE hosts SET state = ?, version = version + 1 WHERE id = ?", [state, host_id]
            if incarnation is not None:
                sql += " AND incarnation = ?"
                params.append(incarnation)
            if c.x(sql, params) != 1:
                raise NotFound(f"no host {host_id!r}" + ("" if incarnation is None else " in this incarnation"))

    def get(self, host_id: str) -> HostInfo:
        with self.backend.control_tx() as c:
            r = c.one(f"SELECT {_COLS} FROM hosts WHERE id = ?", (host_id,))
        if r is None:
            raise NotFound(f"no host {host_id!r}", hint="`moorage hosts` lists the fleet's hosts")
        return _host(r)

    def list(self) -> list[HostInfo]:
        with self.backend.control_tx() as c:
            return [_host(r) for r in c.q(f"SELECT {_COLS} FROM hosts ORDER BY id")]

    def remove(self, host_id: str) -> None:
        with self.backend.control_tx() as c:
            c.x("DELETE FROM hosts WHERE id = ?", (host_id,))
