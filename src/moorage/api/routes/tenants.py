"""Operator routes: create a tenant (guarded by the installation's operator token) and a health check.

The operator token lives in ``<data_dir>/api/operator-token``; it is never a tenant credential.
"""

from __future__ import annotations

from typing import Any

from moorage.api import schemas as S
from moorage.api.readiness import RETRY_AFTER_S
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import ConflictError


#: ``/readyz``'s answer, 200 or 503 (``api/readiness.py``).
READY = S.obj({"status": S.STR, "detail": S.STR, "retry_after": S.INT}, required=["status"])
#: What a caller who asked for a tenant that exists can do (the store's conflict says only that it exists).
TENANT_EXISTS_HINT = ("tenant names are unique and this one is taken: choose another name, or keep using that "
                      "tenant with an API key it already has (its first admin key is not shown again)")


def create_tenant(call: Call) -> Reply:
    name = call.field("name", str)
    try:
        tenant, key = call.ctx.store.operator.create_tenant(name)
    except ConflictError as e:
        raise ConflictError(e.message, hint=TENANT_EXISTS_HINT) from None
    return Reply({"tenant": {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at},
                  "api_key": S.key(key)}, 201)


def health(call: Call) -> dict[str, Any]:
    return {"status": "ok", "runtime": call.ctx.runtime is not None}


async def ready(call: Call) -> Reply:
    """200 while this host should get new requests; 503 with why not (``api/readiness.py``)."""
    r = await call.ctx.readiness.check()
    return Reply(r.body(), 200 if r.ready else 503, {} if r.ready else {"Retry-After": str(RETRY_AFTER_S)})


ENDPOINTS = [
    Endpoint("POST", "/v1/tenants", create_tenant, "Create a tenant and its first admin key (operator token)",
             "operator", "createTenant", auth="operator", status=201, idempotency="none",
             body=S.obj({"name": S.STR}), response=S.obj({"tenant": S.ref("Tenant"), "api_key": S.ref("ApiKey")})),
    Endpoint("GET", "/healthz", health, "Liveness", "operator", "health", auth="none",
             response=S.obj({"status": S.STR, "runtime": {"type": "boolean"}})),
    Endpoint("GET", "/readyz", ready, "Readiness: 503 while stopping, draining or without its store", "operator",
             "ready", auth="none", response=READY, other_responses=((503, READY),)),
]
