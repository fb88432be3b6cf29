"""Cursor pagination for list routes: ``limit`` and an opaque ``cursor``; responses carry ``next_cursor``.

The cursor is an encoded position, not a secret; it is validated like any other input.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any, Callable, Sequence, TypeVar

from moorage.errors import InvalidInput

T = TypeVar("T")
DEFAULT_LIMIT = 50
MAX_LIMIT = 500


def parse_limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_LIMIT
    try:
        n = int(raw)
    except ValueError as e:
        raise InvalidInput(f"limit must be an integer, got {raw!r}", hint=f"1 to {MAX_LIMIT}") from e
    if not 1 <= n <= MAX_LIMIT:
        raise InvalidInput(f"limit must be between 1 and {MAX_LIMIT}, got {n}")
    return n


def encode_cursor(position: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(position, separators=(",", ":")).encode()).rstrip(b"=").decode()


def decode_cursor(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        pos = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except ValueError as e:
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged") from e
    if not isinstance(pos, dict) or not _plain(pos):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    return pos


#: No cursor moorage gives out holds a number beyond this (offsets, sequence numbers, timestamps); a larger one
#: overflowed the store's 64-bit integers (a 500) once added to a page's limit.
_CURSOR_MAX = 2 ** 53


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether a decoded cursor holds only finite numbers within ``_CURSOR_MAX``, a few levels deep."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value) and abs(value) <= _CURSOR_MAX
    if depth >= 4:
        return False
    if isinstance(value, dict):
        return all(_plain(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    return False


def offset_page(fetch: Callable[[int], Sequence[T]], limit: int, cursor: str | None,
                render: Callable[[T], Any]) -> dict[str, Any]:
    """Page through a stably ordered listing: ``fetch(n)`` returns its first ``n`` items."""
    offset = decode_cursor(cursor).get("o", 0)
    if not isinstance(offset, int) or offset < 0:
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    items = list(fetch(offset + limit + 1))
    page = items[offset : offset + limit]
    more = len(items) > offset + limit
    return {"data": [render(i) for i in page], "next_cursor": encode_cursor({"o": offset + limit}) if more else None}


def position(cursor: str | None, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any] | None:
    """The position a keyset cursor holds (None: the first page): every one of ``fields``, of its type."""
    pos = decode_cursor(cursor)
    if not pos:
        return None
    if any(not isinstance(pos.get(k), t) or isinstance(pos.get(k), bool) for k, t in fields.items()):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    return pos


def keyset_page(rows: Sequence[T], limit: int, at: Callable[[T], dict[str, Any]],
                render: Callable[[T], Any]) -> dict[str, Any]:
    """A page of a listing ordered by a unique key, read as ``limit + 1`` rows past the cursor's position: its next
    cursor is the last row's position (``at``), so a page costs the same however deep, and rows added before the
    position never push one onto the next page again."""
    page = rows[:limit]
    return {"data": [render(r) for r in page],
            "next_cursor": encode_cursor(at(page[-1])) if len(rows) > limit else None}
