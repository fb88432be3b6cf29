"""Every HTTP route of the API, grouped by what it manages; ``all_endpoints()`` is the full list.

The cross-tenant suite and the OpenAPI document both read this list, so no route can escape either.
"""

from __future__ import annotations

from moorage.api.routing import Endpoint


def all_endpoints() -> list[Endpoint]:
    from moorage.api.routes import app as app_routes
    from moorage.api.routes import (agents, executions, fleet, invoke, keys, memory, openai_compat, retention, sandboxes,
                                    secrets, tenants, traces, users, webhooks, workflows)
    from moorage.api.routes import checkpoints

    from moorage.api import mcp  # MCP Streamable HTTP per agent (JSON-RPC inside; auth and routing as here)

    out: list[Endpoint] = []
    for module in (tenants, keys, agents, retention, users, invoke, executions, webhooks, memory, workflows, sandboxes, secrets, fleet, traces,
                   openai_compat, mcp, app_routes, checkpoints):
        out.extend(module.ENDPOINTS)
    return out
