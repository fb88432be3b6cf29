"""A tenant's model token budget that never resets (``Budget(window_s=None)``) refuses the same turn for good: the
429 carries no ``Retry-After`` (it used to say 1 s) and says ``x-should-retry: false`` with a hint to raise the
budget, so neither moorage's SDK nor the ``openai`` client asks again; a budget with a window still says when."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.client import AsyncClient, RateLimited
from moorage.llm.limits import Budget, TenantLimits
from tests.api.conftest import aclient, agent_archive


async def test_a_budget_that_never_resets_tells_clients_not_to_retry(live_rt, runtime, acme, store,
                                                                    tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        tenant_id = store.authenticate(acme).tenant_id
        runtime.llm.admission.set_limits(tenant_id, TenantLimits(budget=Budget(tokens=1, window_s=None)))
        refused = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"})
        assert refused.status_code == 429 and refused.json()["type"].endswith("/budget-exceeded"), refused.text
        assert "retry-after" not in refused.headers and "retry_after" not in refused.json(), refused.headers
        assert refused.headers["x-should-retry"] == "false"
        assert "raise the tenant's token budget" in refused.json()["hint"] and "never resets" in refused.json()["hint"]

        # The SDK hands it over at once, as the server asked.
        waits: list[float] = []

        async def sleep(s: float) -> None:
            waits.append(s)

        async with AsyncClient(live_rt.url, acme, sleep=sleep) as sdk:
            with pytest.raises(RateLimited) as e:
                await sdk.invoke("echo", "ask the model", user="ann")
        assert e.value.retryable is False and e.value.retry_after is None and waits == []

        # A budget with a window says when it resets, and may be asked again then.
        runtime.llm.admission.set_limits(tenant_id, TenantLimits(budget=Budget(tokens=1, window_s=3600)))
        later = await c.post("/v1/agents/echo/invoke", json={"message": "ask the model", "user": "ann"})
        assert later.status_code == 429 and int(later.headers["retry-after"]) > 3000, later.headers
        assert "x-should-retry" not in later.headers
