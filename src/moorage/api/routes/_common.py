"""Pieces shared by route modules: standard query parameters and lookups that 404 outside the tenant.

Lookups go through the tenant's store handle, so another tenant's ids are simply not found.
"""

from __future__ import annotations

from moorage.api.routing import Call, Param
from moorage.errors import InvalidInput
from moorage.store import Agent
from moorage.store.model import check_id

LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}, "page size")
CURSOR = Param("cursor", {"type": "string"}, "next_cursor of the previous page")
PAGE = (LIMIT, CURSOR)


def agent_of(call: Call) -> Agent:
    """The path's agent in the caller's tenant (404 if it is not there)."""
    return call.tenant.agents.get(check_id(call.path["agent"], "agent name"))


def float_query(call: Call, name: str) -> float | None:
    raw = call.query(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError as e:
        raise InvalidInput(f"{name} must be a number (seconds since the epoch), got {raw!r}") from e
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidInput(f"{name} must be a finite number")
    return value


def bool_query(call: Call, name: str) -> bool:
    raw = (call.query(name) or "").lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise InvalidInput(f"{name} must be true or false, got {raw!r}")
