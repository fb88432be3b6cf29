"""Generic versioned key-value state per scope: every put and delete is compare-and-set on the
record's version."""

from __future__ import annotations

from typing import Any

from moorage.errors import ConflictError
from moorage.store.model import Record, Scope
from moorage.store.repos.common import _check_key, _check_version, _now, _Repo
from moorage.store.sql import loads


class State(_Repo):
    """Versioned key-value records per scope. ``put`` is compare-and-set; 0 means "must not exist"."""

    def get(self, scope: Scope, key: str) -> Record | None:
        _check_key(key)
        with self._ts._tx(write=False) as c:
            r = c.one("SELECT value, version, updated_at FROM state WHERE scope = ? AND key = ?", (scope.key, key))
        return None if r is None else Record(scope, key, loads(r[0]), r[1], r[2])

    def put(self, scope: Scope, key: str, value: Any, *, expected_version: int) -> Record:
        _check_key(key)
        _check_version(expected_version)
        text = self._json(value)
        now = _now()
        with self._ts._tx() as c:
            if expected_version == 0:
                # ON CONFLICT DO NOTHING: two creators racing get one winner and one ConflictError,
                # never a unique-violation that aborts the loser's whole transaction.
                n = c.x(
                    "INSERT INTO state (scope, key, value, version, updated_at) VALUES (?, ?, ?, 1, ?) ON CONFLICT DO NOTHING",
                    (scope.key, key, text, now),
                )
                if n != 1:
                    cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                    raise ConflictError(f"{key!r} already exists in {scope}", current_version=cur[0] if cur else None)
            else:
                n = c.x(
                    "UPDATE state SET value = ?, version = version + 1, updated_at = ? WHERE scope = ? AND key = ? AND version = ?",
                    (text, now, scope.key, key, expected_version),
                )
                if n != 1:
                    cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                    if cur is None:
                        raise ConflictError(f"{key!r} does not exist in {scope}", current_version=0)
                    raise ConflictError(
                        f"{key!r} in {scope} is at version {cur[0]}, not {expected_version}", current_version=cur[0]
                    )
            self._ts._touch(c, scope, now)
        return Record(scope, key, value, expected_version + 1, now)

    def delete(self, scope: Scope, key: str, *, expected_version: int) -> None:
        _check_key(key)
        _check_version(expected_version)
        with self._ts._tx() as c:
            n = c.x("DELETE FROM state WHERE scope = ? AND key = ? AND version = ?", (scope.key, key, expected_version))
            if n != 1:
                cur = c.one("SELECT version FROM state WHERE scope = ? AND key = ?", (scope.key, key))
                raise ConflictError(f"cannot delete {key!r}: version changed", current_version=cur[0] if cur else 0)

    def list(self, scope: Scope, *, prefix: str = "", limit: int = 1000) -> list[Record]:
        with self._ts._tx(write=False) as c:
            rows = c.q(
                "SELECT key, value, version, updated_at FROM state WHERE scope = ? AND key >= ? ORDER BY key LIMIT ?",
                (scope.key, prefix, limit),
            )
        return [Record(scope, r[0], loads(r[1]), r[2], r[3]) for r in rows if r[0].startswith(prefix)]
