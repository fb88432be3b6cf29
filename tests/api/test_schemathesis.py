"""Property tests against the served OpenAPI document (schemathesis): for generated requests to every
operation, no 5xx, and every response matches its documented status, content type and schema."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import aclient, agent_archive

# Deploy bodies are raw archives: send generated binary data as is (mostly not gzip, so a 422 is expected).
schemathesis.serializer.alias("application/gzip", "application/octet-stream")

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
#: Examples per operation: enough to reach the validation and not-found paths, bounded to keep the run short.
EXAMPLES = 25
#: Turn operations start sandboxes when they hit a real agent, so they get fewer.
TURN_EXAMPLES = 4
TURN_OPS = {"invokeAgent", "createChatCompletion", "answerWorkflow"}


def fuzz(url: str, secret: str) -> tuple[int, list[str]]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        op = result.ok()
        n = TURN_EXAMPLES if op.definition.raw.get("operationId") in TURN_OPS else EXAMPLES

        @given(case=op.as_strategy())
        @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            nonlocal calls
            response = case.call(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=60)
            calls += 1
            case.validate_response(response, checks=CHECKS)

        try:
            check()
        except BaseException as e:  # noqa: BLE001 - collect every operation's failure (groups too), report together
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"{op.label}: {str(e)[:1500]}")
    return calls, failures


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_every_operation_conforms_to_the_spec(live_rt, acme, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201
        await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u1"})
    # schemathesis calls are blocking: run them in a thread while this loop keeps serving.
    calls, failures = await asyncio.to_thread(fuzz, live_rt.url, acme)
    assert calls > 100
    assert failures == [], "\n\n".join(failures)
