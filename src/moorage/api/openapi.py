"""The OpenAPI 3.1 document, generated from the declared endpoints (the repo copy is docs/openapi.json).

Regenerate the repo copy with ``python -m moorage.api.openapi > docs/openapi.json``; a test keeps them equal.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moorage import __version__
from moorage.api import schemas as S
from moorage.api.routing import Endpoint

#: A path parameter, with Starlette's converter (``{path:path}``) left out of the document.
_PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")


#: An agent's app answers with its own statuses and content types; the route relays them as they are.
_RELAYED = {f"{n}XX": {"description": "the agent's app's own answer, relayed as it is",
                       "content": {"*/*": {"schema": {}}}} for n in (2, 3, 4, 5)}
#: A redirect answers no body, only where to go.
_REDIRECT = {"description": "a redirect to the URL in Location", "headers": {"Location": {"schema": {"type": "string"}}}}


#: A deployment's number in a path (1 or more).
_NUMBER = {"type": "string", "pattern": "^[1-9][0-9]{0,17}$"}


def _operation(ep: Endpoint) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {"name": n, "in": "path", "required": True, "schema": S.ID if n in ("agent", "user") else
         _NUMBER if n == "number" else {"type": "string", "minLength": 1}}
        for n in _PARAM.findall(ep.path)
    ]
    params += [{"name": q.name, "in": "query", "required": q.required, "schema": q.schema,
                **({"description": q.description} if q.description else {})} for q in ep.query]
    if ep.method in ("POST", "PUT", "PATCH", "DELETE") and ep.idempotency != "none":
        params.append({"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": r"^[\x21-\x7e]{1,200}$"},
                       "description": "replays of the same request return the first response"})
    content: dict[str, Any] = {"application/json": {"schema": ep.response or S.OBJ}}
    if ep.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "operationId": ep.operation_id,
        "summary": ep.summary,
        "tags": [ep.tag],
        "parameters": params,
        "responses": {
            **(_RELAYED if ep.relayed else {
                str(ep.status): _REDIRECT if 300 <= ep.status < 400 else {"description": "success", "content": content}}),
            # A schema of None: the status has no body (e.g. 202 to a notification).
            **{str(status): {"description": "success",
                             **({"content": {"application/json": {"schema": schema}}} if schema is not None else {})}
               for status, schema in ep.other_responses},
            "default": {"description": "an error (RFC 9457 problem)",
                        "content": {"application/problem+json": {"schema": S.ref("Problem")}}},
        },
    }
    if ep.body is not None:
        op["requestBody"] = {"required": ep.body_type != "application/json" or bool(ep.body.get("required")),
                             "content": {ep.body_type: {"schema": ep.body}}}
    elif ep.body_doc is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ep.body_doc}}}
    if ep.auth == "none":
        op["security"] = []
    elif ep.auth == "operator":
        op["security"] = [{"operatorToken": []}]
    else:
        scope = "needs a key with the " + " or ".join(f"`{s}`" for s in sorted(ep.scopes - {"admin"}) or ["admin"]) + " scope"
        op["description"] = scope + ("; end-user tokens allowed for their own agent and user" if ep.end_user else "")
    return op


def build_spec(endpoints: list[Endpoint]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        paths.setdefault(_PARAM.sub(r"{\1}", ep.path), {})[ep.method.lower()] = _operation(ep)
    return {
        "openapi": "3.1.0",
        "info": {"title": "moorage", "version": __version__,
                 "description": "Persistent per-user AI agents. Errors are RFC 9457 problem+json; every response "
                                "carries X-Trace-Id."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": S.COMPONENTS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "a tenant API key (mrg_...) or an end-user token (mrgu_...)"},
                "operatorToken": {"type": "http", "scheme": "bearer",
                                  "description": "the installation's operator token (<data_dir>/api/operator-token)"},
            },
        },
    }


def render(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    from moorage.api.routes import all_endpoints

    print(render(build_spec(all_endpoints())), end="")
