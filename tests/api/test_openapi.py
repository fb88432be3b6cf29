"""The OpenAPI document: served at /openapi.json, equal to the repo copy, covering every route."""

from __future__ import annotations

import json
import re
from pathlib import Path

from starlette.routing import Route

from tests.api.conftest import acme, live_rt, runtime  # noqa: F401 - fixtures

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


async def test_a_turn_that_answers_json_and_a_forgotten_user_match_their_documented_schemas(
        live_rt, acme: str, tmp_path: Path) -> None:  # noqa: F811
    # An agent may return any JSON value; the document said a reply was a string or null (a generated client
    # then refused the answer), and a forgotten user's answer carried a field the document did not name.
    import jsonschema

    from tests.api.conftest import aclient
    from tests.runtime.conftest import write_agent
    from moorage.cli.up import tar_dir

    spec = json.loads(REPO_SPEC.read_text())

    def check(body: dict, name: str) -> None:
        schema = {**spec["components"]["schemas"][name], "components": spec["components"]}
        jsonschema.validate(body, schema)
        assert set(body) <= set(schema["properties"]), f"{name} does not name {set(body) - set(schema['properties'])}"

    src = write_agent(tmp_path / "agent", "shape", "async def on_message(ctx, message):\n"
                                                   "    return {'said': message, 'words': message.split()}\n")
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/shape/deployments", content=tar_dir(src), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/agents/shape/invoke", json={"message": "two words", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"] == {"said": "two words", "words": ["two", "words"]}
        check(r.json(), "TurnResult")
        r = await c.delete("/v1/agents/shape/users/ada")
        assert r.status_code == 200, r.text
        check(r.json(), "Forgotten")
