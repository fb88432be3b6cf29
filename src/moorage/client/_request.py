"""One request of the public API as the clients send it, and the helpers that build its path and query safely."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from moorage.client.errors import InvalidArgument


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    #: A field of the answer shown once (a secret, a token): a retry's replayed answer has it null (see
    #: ``_transport.check_shown_once``), and is then an error rather than a record without it.
    shown_once: str | None = None
    #: What the caller does about such a lost secret (the hint of that error).
    shown_once_hint: str = ""
    #: The server does it again when it is sent again (no replay by Idempotency-Key: a synchronous exec), so it is
    #: retried only when it surely was not done (see ``_transport.may_have_run``).
    repeats: bool = False


def _p(value: str) -> str:
    """One path segment: quoted whole, so an id can never reach another route (``/``, ``?``, ``#``); an empty
    one, ``.`` or ``..`` (which URL rules resolve away) is refused before anything is sent."""
    text = str(value)
    if text in ("", ".", ".."):
        raise InvalidArgument(f"{text!r} is not a valid id", hint="ids are letters, digits, '.', '_' and '-'")
    return quote(text, safe="")


def _page(limit: int | None, cursor: str | None, **extra: Any) -> dict[str, Any]:
    params = {k: v for k, v in extra.items() if v is not None}
    if limit is not None:
        params["limit"] = limit
    if cursor is not None:
        params["cursor"] = cursor
    return params


def _idem(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key} if key else {}
