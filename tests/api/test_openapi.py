"""The OpenAPI document: served at /openapi.json, equal to the repo copy, covering every route."""

from __future__ import annotations

import json
import re
from pathlib import Path

from starlette.routing import Route

REPO_SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_served_spec_equals_the_repo_copy(live):
    with live.client() as c:
        served = c.get("/openapi.json").json()
    assert served == json.loads(REPO_SPEC.read_text()), (
        "docs/openapi.json is stale: run `python -m moorage.api.openapi > docs/openapi.json`"
    )
    assert served["openapi"].startswith("3.1")


def test_every_app_route_is_documented(live):
    spec = json.loads(REPO_SPEC.read_text())
    undocumented = []
    for route in live.app.routes:
        if not isinstance(route, Route) or route.path in ("/openapi.json", "/metrics"):
            continue
        for method in route.methods or ():
            documented = re.sub(r"{([^}:]+):[^}]*}", r"{\1}", route.path)  # {path:path} is {path} in OpenAPI
            if method != "HEAD" and method.lower() not in spec["paths"].get(documented, {}):
                undocumented.append(f"{method} {route.path}")
    assert undocumented == []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert "default" in op["responses"], f"{method} {path} documents no error response"
