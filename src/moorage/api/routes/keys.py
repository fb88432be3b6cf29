"""API keys of the caller's tenant: list, create (secret shown once; scopes, optionally one agent), revoke (admin
scope; revoking a key also invalidates every end-user token it issued and cancels the async turns and detached execs
it started), and what the caller's own credential may do.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.routes._common import PAGE
from moorage.api.pagination import offset_page, parse_limit
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import InvalidInput
from moorage.store import ApiKey
from moorage.store.model import API_KEY_SCOPES


def _key(k: ApiKey) -> dict[str, Any]:
    return {**S.key(k), "agent": k.agent}


def list_keys(call: Call) -> dict[str, Any]:
    keys = call.tenant.keys.list()
    return offset_page(lambda n: keys[:n], parse_limit(call.query("limit")), call.query("cursor"), _key)


def create_key(call: Call) -> Reply:
    scopes = call.field("scopes", list)
    if not all(isinstance(s, str) for s in scopes):
        raise InvalidInput("scopes must be a list of strings", hint=f"choose from {', '.join(API_KEY_SCOPES)}")
    label = call.field("label", str, required=False, default="")
    agent = call.field("agent", str, required=False)
    return Reply(_key(call.tenant.keys.create(scopes, label, agent)), 201)


async def revoke_key(call: Call) -> dict[str, Any]:
    """Revoke the key; the detached work it started (async turns, detached execs) is cancelled, naming it: queued
    turns here and now, running work by the host that runs it within seconds (``runtime/revoked_work.py``)."""
    key_id = call.path["key_id"]
    await run_in_threadpool(call.tenant.keys.revoke, key_id)
    if call.ctx.runtime is not None:  # a server without a runtime runs no work
        from moorage.runtime.revoked_work import RevokedWork

        await RevokedWork.of(call.ctx.runtime).revoked(call.tenant, key_id)
    return {"revoked": key_id}


def whoami(call: Call) -> dict[str, Any]:
    """The caller's own credential: what it may do, so a client (the dashboard) offers only that."""
    p = call.who
    end_user = p.user is not None
    return {"kind": "end-user" if end_user else "key", "key_id": p.key_id,
            "scopes": [] if end_user else sorted(p.scopes), "agent": p.agent, "user": p.user}


WHOAMI = S.obj({"kind": {"enum": ["key", "end-user"]}, "key_id": S.NSTR,
                "scopes": {"type": "array", "items": {"enum": list(API_KEY_SCOPES)}}, "agent": S.NSTR, "user": S.NSTR})

ENDPOINTS = [
    Endpoint("GET", "/v1/whoami", whoami, "The caller's own credential: its kind, scopes, agent and user",
             "keys", "whoami", scope="read", also_scopes=tuple(s for s in API_KEY_SCOPES if s != "read"),
             end_user=True, agent_checked=True, response=WHOAMI),
    Endpoint("GET", "/v1/keys", list_keys, "List API keys", "keys", "listKeys", scope="admin", query=PAGE,
             response=S.page_of("ApiKey")),
    Endpoint("POST", "/v1/keys", create_key, "Create an API key (its secret is returned once)", "keys", "createKey",
             scope="admin", status=201, secret_fields=("secret",),
             body=S.obj({"scopes": {"type": "array", "items": {"enum": list(API_KEY_SCOPES)}, "minItems": 1},
                         "label": S.STR, "agent": S.ID}, ["scopes"]),
             response=S.ref("ApiKey")),
    Endpoint("DELETE", "/v1/keys/{key_id}", revoke_key, "Revoke an API key", "keys", "revokeKey", scope="admin",
             response=S.obj({"revoked": S.STR})),
]
