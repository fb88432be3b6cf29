"""Operator routes: create a tenant, read or set its limits, delete it (guarded by the installation's operator
token), and the health checks.

The operator token lives in ``<data_dir>/api/operator-token``; it is never a tenant credential.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from moorage.api import schemas as S
from moorage.api.detached import detached
from moorage.api.pagination import offset_page, parse_limit
from moorage.api.readiness import RETRY_AFTER_S
from moorage.api.routes._common import PAGE, releaser
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import ConflictError, InvalidInput
from moorage.fleet.forward import LET_GO, forwarded
from moorage.usage import tenant_cap


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


def list_tenants(call: Call) -> dict[str, Any]:
    """Every tenant, by name: its own limits and, for a delete cut short, when its deletion began."""
    operator = call.ctx.store.operator
    tenants = operator.list_tenants()
    return offset_page(lambda n: tenants[:n], parse_limit(call.query("limit")), call.query("cursor"),
                       lambda t: {"id": t.id, "name": t.name, "created_at": t.created_at,
                                  "limits": operator.tenant_limits(t.id), "deleting_since": t.deleting_since})


#: A tenant's limits as the operator set them, and what applies (``storage_mib``: its own, else the default).
LIMITS = S.obj({"tenant": S.obj({"id": S.STR, "name": S.STR}),
                "limits": S.obj({"storage_mib": S.NUM}, required=[]),  # {}: none of its own
                "storage_mib": S.NUM, "default_storage_mib": S.NUM})


def _limits(call: Call, name_or_id: str, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    tenant = call.ctx.store.backend.get_tenant(name_or_id)  # a 404 for a tenant the store does not have
    own = call.ctx.store.operator.tenant_limits(tenant.id) if limits is None else limits
    default = tenant_cap.default_of(call.ctx.config)
    return {"tenant": {"id": tenant.id, "name": tenant.name}, "limits": own,
            "storage_mib": own.get("storage_mib", default), "default_storage_mib": default}


def tenant_limits(call: Call) -> dict[str, Any]:
    return _limits(call, call.path["tenant"])


def set_tenant_limits(call: Call) -> dict[str, Any]:
    body = call.body if isinstance(call.body, dict) else {}
    if "storage_mib" not in body:
        raise InvalidInput("missing field 'storage_mib'",
                           hint="a number of MiB (0: no ceiling), or null for the installation's tenant_max_storage_mib")
    name = call.path["tenant"]
    limits = call.ctx.store.operator.set_tenant_limits(name, storage_mib=body["storage_mib"])
    answer = _limits(call, name, limits)
    # This host judges the tenant's next write by it; the fleet's other hosts read it within LIMITS_EVERY_S.
    tenant_cap.limits_changed(call.ctx.store, answer["tenant"]["id"])
    return answer


async def delete_tenant(call: Call) -> Reply:
    """Delete the tenant and everything it has (runtime/tenant_delete.py); streamed with ``?stream=true``."""
    name = call.path["tenant"]
    if forwarded.get() and call.request.headers.get(LET_GO):
        # Another host serves this delete and asks this one to let go of the tenant's instances it holds awake.
        await call.runtime.let_go_tenant(name)
        return Reply({"tenant": {"id": "", "name": name}, "deleted": False, "agents": 0, "users": 0, "removed": 0,
                      "keys_revoked": 0}, 200)
    runtime = call.runtime  # a store-only server has none: a 503 before anything starts
    tenant = await run_in_threadpool(call.ctx.store.backend.get_tenant, name)  # 404 before anything starts
    release = releaser(call)
    return await detached(call, f"delete-tenant-{tenant.id}",
                          lambda progress: runtime.delete_tenant(tenant.id, on_progress=progress,
                                                                 **({"release": release} if release else {})),
                          "deleted", dict, 200)


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
    Endpoint("GET", "/v1/tenants", list_tenants,
             "List tenants by name, each with its own limits and, while it is being deleted, since when (operator "
             "token)", "operator", "listTenants", auth="operator", query=PAGE, response=S.page_of("Tenant")),
    Endpoint("GET", "/v1/tenants/{tenant}/limits", tenant_limits,
             "A tenant's limits (by name or id): its own storage ceiling, and the one that applies (operator token)",
             "operator", "getTenantLimits", auth="operator", response=LIMITS),
    Endpoint("PUT", "/v1/tenants/{tenant}/limits", set_tenant_limits,
             "Set a tenant's own storage ceiling in MiB (0: none; null: the installation's default) (operator token)",
             "operator", "setTenantLimits", auth="operator", idempotency="none",
             body=S.obj({"storage_mib": S.NNUM}, required=["storage_mib"]), response=LIMITS),
    Endpoint("DELETE", "/v1/tenants/{tenant}", delete_tenant,
             "Delete a tenant (by name or id) and everything it has: its keys, agents, end-users, instances and "
             "store; with ?stream=true, progress as it goes (operator token)",
             "operator", "deleteTenant", auth="operator", idempotency="none", streams=True,
             response=S.ref("TenantDeleted")),
    Endpoint("GET", "/healthz", health, "Liveness", "operator", "health", auth="none",
             response=S.obj({"status": S.STR, "runtime": {"type": "boolean"}})),
    Endpoint("GET", "/readyz", ready, "Readiness: 503 while stopping, draining or without its store", "operator",
             "ready", auth="none", response=READY, other_responses=((503, READY),)),
]
