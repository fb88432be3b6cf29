"""Sandbox records: where each agent instance's sandbox lives, its state and its snapshot and disk
references, changed by compare-and-set on the version."""

from __future__ import annotations

from typing import Any, Sequence

from moorage.errors import ConflictError, NotFound
from moorage.store.model import SandboxRecord, Scope
from moorage.store.repos.common import _check_version, _new_id, _now, _Repo
from moorage.store.sql import loads


_SBX_COLS = ("id, agent_id, scope, state, host, snapshot_ref, disk_ref, template_ref, last_active, ttl_s, meta, created_at, "
             "version, lease_epoch")


def _sandbox(r: tuple) -> SandboxRecord:
    return SandboxRecord(r[0], r[1], Scope.parse(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9], loads(r[10]), r[11], r[12],
                         int(r[13]))


class LeaseLost(ConflictError):
    """This host no longer owns the instance: another host took it over under a newer fencing epoch."""

    code = "lease-lost"

    def __init__(self, sandbox_id: str, host: str | None, epoch: int) -> None:
        super().__init__(f"instance {sandbox_id} is now owned by host {host!r} (epoch {epoch}); this host lost it",
                         hint="retry: the request is served by the instance's current host")


class Sandboxes(_Repo):
    """Where each agent instance's sandbox is and what state it is in (placement lives here, not in memory)."""

    def create(self, scope: Scope, *, state: str, host: str | None = None, template_ref: str | None = None,
               ttl_s: float | None = None, meta: dict[str, Any] | None = None, sandbox_id: str | None = None) -> SandboxRecord:
        now = _now()
        rec = SandboxRecord(sandbox_id or _new_id(), scope.agent, scope, state, host, None, None, template_ref, now, ttl_s,
                            meta or {}, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO sandboxes ({_SBX_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 0) ON CONFLICT DO NOTHING",
                (rec.id, rec.agent_id, scope.key, state, host, None, None, template_ref, now, ttl_s, self._json(rec.meta), now),
            )
            if n != 1:
                existing = c.one("SELECT id, version FROM sandboxes WHERE scope = ?", (scope.key,))
                raise ConflictError(f"{scope} already has a sandbox", current_version=existing[1] if existing else None)
            self._ts._touch(c, scope, now)
        return rec

    def get(self, sandbox_id: str) -> SandboxRecord:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE id = ?", (sandbox_id,))
        if r is None:
            raise NotFound(f"no sandbox {sandbox_id!r}")
        return _sandbox(r)

    def for_scope(self, scope: Scope) -> SandboxRecord | None:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE scope = ?", (scope.key,))
        return None if r is None else _sandbox(r)

    def for_scopes(self, scopes: Sequence[Scope]) -> dict[str, SandboxRecord]:
        """The instances of ``scopes`` (by scope key; a scope without one is missing), in one query."""
        keys = sorted({s.key for s in scopes})
        if not keys:
            return {}
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_SBX_COLS} FROM sandboxes WHERE scope IN ({','.join('?' * len(keys))})", keys)
        return {rec.scope.key: rec for rec in map(_sandbox, rows)}

    def of_user(self, agent: str, user: str) -> list[SandboxRecord]:
        """The instances of ``user`` of ``agent``: their user's, their sessions' and their workflow runs' (scope keys
        ``kind:agent/user[/ref]``, read as ranges of the scope index, not by reading the agent's every instance)."""
        # One seek per kind (a UNION: an OR of them lets PostgreSQL walk all of a small tenant's instances).
        sql = " UNION ALL ".join([f"SELECT {_SBX_COLS} FROM sandboxes WHERE scope = ?"]
                                 + [f"SELECT {_SBX_COLS} FROM sandboxes WHERE scope >= ? AND scope < ?"] * 2)
        params = [f"user:{agent}/{user}"]
        for kind in ("session", "workflow"):  # "0" is the character after "/"
            params += [f"{kind}:{agent}/{user}/", f"{kind}:{agent}/{user}0"]
        with self._ts._tx(write=False) as c:
            rows = c.q(sql, params)
        recs = [r for r in map(_sandbox, rows) if r.scope.agent == agent and r.scope.user == user]
        return sorted(recs, key=lambda r: (r.last_active, r.id))

    def count_by_state(self, *, agent_id: str | None = None) -> dict[str, int]:
        """How many instances are in each state (of ``agent_id``'s), counted by the store."""
        where, params = ("WHERE agent_id = ?", [agent_id]) if agent_id is not None else ("", [])
        with self._ts._tx(write=False) as c:
            return {r[0]: int(r[1]) for r in c.q(f"SELECT state, COUNT(*) FROM sandboxes {where} GROUP BY state", params)}

    def most_recent(self, *, limit: int, agent_id: str | None = None) -> list[SandboxRecord]:
        """The ``limit`` most recently active instances (of ``agent_id``), newest first."""
        where, params = ("WHERE agent_id = ?", [agent_id]) if agent_id is not None else ("", [])
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_SBX_COLS} FROM sandboxes {where} ORDER BY last_active DESC, id DESC LIMIT ?",
                       (*params, limit))
        return [_sandbox(r) for r in rows]

    def get_many(self, ids: Sequence[str]) -> list[SandboxRecord]:
        """The instances of ``ids`` that exist, in no particular order."""
        out: list[SandboxRecord] = []
        ids = sorted(set(ids))
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            with self._ts._tx(write=False) as c:
                out += map(_sandbox, c.q(f"SELECT {_SBX_COLS} FROM sandboxes WHERE id IN ({','.join('?' * len(chunk))})",
                                         chunk))
        return out

    def seconds_in(self, states: Sequence[str], since: float, now: float, *, agent_id: str | None = None) -> float:
        """Seconds within [since, now] that the instances now in one of ``states`` (of ``agent_id``) existed, summed:
        each from ``since`` or its creation, whichever is later."""
        if since >= now or not states:
            return 0.0
        later = "GREATEST" if self._ts.dialect == "postgres" else "MAX"
        where, params = f"state IN ({','.join('?' * len(states))}) AND created_at < ?", [*states, now]
        if agent_id is not None:
            where += " AND agent_id = ?"
            params.append(agent_id)
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT SUM(? - {later}(?, created_at)) FROM sandboxes WHERE {where}", (now, since, *params))
        return float(r[0] or 0.0) if r else 0.0

    def list(self, *, states: Sequence[str] | None = None, host: str | None = None, agent_id: str | None = None,
             limit: int = 1000, after: tuple[float, str] | None = None) -> list[SandboxRecord]:
        """Least recently active first (then by id); ``after``: only those past that (last_active, id)."""
        where, params = "1 = 1", []
        if states:
            where += f" AND state IN ({','.join('?' * len(states))})"
            params += list(states)
        if host is not None:
            where += " AND host = ?"
            params.append(host)
        if agent_id is not None:
            where += " AND agent_id = ?"
            params.append(agent_id)
        if after is not None:
            # As a row value, so the (last_active, id) indexes seek to it (an OR of the two read from the start).
            where += " AND (last_active, id) > (?, ?)"
            params += [after[0], after[1]]
        with self._ts._tx(write=False) as c:
            return [_sandbox(r) for r in c.q(f"SELECT {_SBX_COLS} FROM sandboxes WHERE {where} "
                                             "ORDER BY last_active, id LIMIT ?", (*params, limit))]

    _UNSET: Any = object()

    def update(self, sandbox_id: str, *, expected_version: int, state: str | None = None, host: Any = _UNSET,
               snapshot_ref: Any = _UNSET, disk_ref: Any = _UNSET, last_active: float | None = None,
               meta: dict[str, Any] | None = None) -> SandboxRecord:
        _check_version(expected_version)
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_SBX_COLS} FROM sandboxes WHERE id = ?", (sandbox_id,))
            if cur is None:
                raise NotFound(f"no sandbox {sandbox_id!r}")
            r = _sandbox(cur)
            u = self._UNSET
            new_host = r.host if host is u else host
            # The fencing epoch moves with ownership: a record taken by another host gets a new one.
            epoch = r.lease_epoch + 1 if new_host is not None and new_host != r.host else r.lease_epoch
            new = SandboxRecord(
                r.id, r.agent_id, r.scope, r.state if state is None else state, new_host,
                r.snapshot_ref if snapshot_ref is u else snapshot_ref, r.disk_ref if disk_ref is u else disk_ref,
                r.template_ref, r.last_active if last_active is None else last_active, r.ttl_s,
                r.meta if meta is None else meta, r.created_at, expected_version + 1, epoch,
            )
            n = c.x(
                "UPDATE sandboxes SET state = ?, host = ?, snapshot_ref = ?, disk_ref = ?, last_active = ?, meta = ?, "
                "lease_epoch = ?, version = version + 1 WHERE id = ? AND version = ?",
                (new.state, new.host, new.snapshot_ref, new.disk_ref, new.last_active, self._json(new.meta), epoch,
                 sandbox_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"sandbox {sandbox_id} changed (now version {r.version}, state {r.state})", current_version=r.version)
            self._ts._touch(c, r.scope, _now())
        return new

    def fence(self, sandbox_id: str, host: str, epoch: int) -> None:
        """Inside a transaction: raise ``LeaseLost`` unless ``host`` still owns the instance under ``epoch``. On
        PostgreSQL the row stays share-locked until the transaction ends, so a takeover waits for this commit."""
        lock = " FOR SHARE" if self._ts.dialect == "postgres" else ""
        with self._ts._tx() as c:
            r = c.one(f"SELECT host, lease_epoch FROM sandboxes WHERE id = ?{lock}", (sandbox_id,))
        if r is None or r[0] != host or int(r[1]) != epoch:
            raise LeaseLost(sandbox_id, None if r is None else r[0], -1 if r is None else int(r[1]))

    def delete(self, sandbox_id: str, *, expected_version: int) -> None:
        with self._ts._tx() as c:
            n = c.x("DELETE FROM sandboxes WHERE id = ? AND version = ?", (sandbox_id, expected_version))
            if n != 1:
                cur = c.one("SELECT version FROM sandboxes WHERE id = ?", (sandbox_id,))
                raise ConflictError(f"cannot delete sandbox {sandbox_id}: it changed", current_version=cur[0] if cur else None)
