"""What every tenant repository shares: the ``_Repo`` base bound to a ``TenantStore``, ids, clocks
and the checks of keys and versions."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from moorage.errors import InvalidInput
from moorage.store.sql import check_text, dumps

if TYPE_CHECKING:
    from moorage.store.tenant import TenantStore

_MAX_KEY = 256
_MAX_TEXT = 256 * 1024
#: Rows a sweep deletes per transaction: each holds the tenant's write lock (SQLite) only that long, so turns
#: go on between batches of a big backlog (a year of spans after its TTL was shortened, a host long stopped).
SWEEP_BATCH = 1000


def _now() -> float:
    return time.time()


def _new_id() -> str:
    return uuid.uuid4().hex


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY or "\x00" in key:
        raise InvalidInput(f"malformed key {key!r}", hint=f"a non-empty string of at most {_MAX_KEY} characters")
    return key


def _check_version(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InvalidInput(f"expected_version must be a non-negative integer, got {v!r}")
    return v


class _Repo:
    def __init__(self, ts: TenantStore) -> None:
        self._ts = ts

    def _json(self, value: Any, what: str = "value") -> str:
        return dumps(value, self._ts.max_value_bytes, what)

    def _delete_batched(self, table: str, key: str, where: str, params: tuple[Any, ...] = (),
                        batch: int | None = None) -> int:
        """Delete the rows of ``table`` matching ``where``, ``batch`` (``SWEEP_BATCH``) of them per transaction, by
        their unique ``key``; rows deleted. Inside a caller's transaction the batches join it."""
        n, size = 0, batch or SWEEP_BATCH
        while True:
            with self._ts._tx() as c:
                got = c.x(f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} WHERE {where} LIMIT ?)",
                          (*params, size))
            n += got
            if got < size:
                return n

    def _text(self, value: object, what: str) -> str:
        return check_text(value, what, min(self._ts.max_value_bytes, _MAX_TEXT))
