"""A thin connection wrapper that lets one set of SQL statements run on SQLite and PostgreSQL.

Statements are written with ``?`` placeholders; the PostgreSQL dialect rewrites them to ``%s``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Iterable, Sequence

from moorage.errors import InvalidInput


@lru_cache(maxsize=512)
def _to_pyformat(sql: str) -> str:
    # Our statements never contain literal "?" or "%", so a plain rewrite is exact.
    return sql.replace("%", "%%").replace("?", "%s")


class Conn:
    """One open transaction on one backend connection."""

    def __init__(self, raw: Any, dialect: str) -> None:
        self.raw = raw
        self.dialect = dialect

    def _sql(self, sql: str) -> str:
        return _to_pyformat(sql) if self.dialect == "postgres" else sql

    def q(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        cur = self.raw.execute(self._sql(sql), tuple(params))
        return list(cur.fetchall())

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        cur = self.raw.execute(self._sql(sql), tuple(params))
        return cur.fetchone()

    def x(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = self.raw.execute(self._sql(sql), tuple(params))
        return cur.rowcount

    def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        cur = self.raw.cursor()
        cur.executemany(self._sql(sql), [tuple(r) for r in rows])

    def blob(self, value: bytes | None) -> Any:
        return value


def dumps(value: Any, limit: int, what: str = "value") -> str:
    """Serialise a JSON value and enforce the size limit before anything is written."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{what} is not JSON-serialisable: {e}", hint="store plain JSON values") from e
    if len(text.encode()) > limit:
        raise InvalidInput(
            f"{what} is {len(text.encode())} bytes, over the {limit}-byte limit",
            hint="store large data as a file in the sandbox and keep a reference here",
        )
    return text


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def check_text(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    if len(value.encode()) > limit:
        raise InvalidInput(f"{what} is {len(value.encode())} bytes, over the {limit}-byte limit")
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character")
    return value
