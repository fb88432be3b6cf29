"""An agent whose own code raises: the caller gets its error (not a generic one), the official clients do not retry
it (``x-should-retry: false``), and the same turn asked again with its Idempotency-Key answers the same failure
instead of running the agent a second time. Against a real server over the real runtime."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from moorage import AsyncClient
from moorage.client import ServerError
from tests.api.test_retry_after import archive

FAILING = '''
async def on_message(ctx, message):
    failed = int(ctx.files.read("failed.txt")) if ctx.files.exists("failed.txt") else 0
    if message == "count":
        return str(failed)
    ctx.files.write("failed.txt", str(failed + 1))  # a side effect of every run of the failing turn
    raise ValueError(f"refund {message} refused")
'''


async def test_an_agent_error_reaches_the_caller_once_and_is_not_run_again(live_rt, acme, tmp_path: Path):
    async with AsyncClient(live_rt.url, acme, max_retries=3, backoff_s=0.01) as sdk:
        await sdk.deploy("payer", archive(tmp_path, "payer", FAILING))
        with pytest.raises(ServerError) as first:
            await sdk.invoke("payer", "r-1", user="ann", idempotency_key="k-1")
        assert first.value.status == 502 and first.value.code == "agent-error"
        assert "refund r-1 refused" in str(first.value) and first.value.retryable is False
        assert [s for _, p, s in sdk.attempts if p == "/v1/agents/payer/invoke"] == [502], "not retried"

        # The same turn asked again (same key): its failure again, the agent not run again.
        with pytest.raises(ServerError) as again:
            await sdk.invoke("payer", "r-1", user="ann", idempotency_key="k-1")
        assert (again.value.code, again.value.detail) == ("agent-error", first.value.detail)
        assert (await sdk.invoke("payer", "count", user="ann"))["reply"] == "1"

        # Streamed (it failed before its first event: the answer is the error itself), not retried either.
        with pytest.raises(ServerError, match="refund r-2 refused"):
            _ = [ev async for ev in sdk.stream("payer", "r-2", user="ann")]

    # Raw HTTP: the header the clients honour.
    async with httpx.AsyncClient(base_url=live_rt.url, headers={"authorization": f"Bearer {acme}"}) as h:
        r = await h.post("/v1/agents/payer/invoke", json={"message": "r-3", "user": "ann"})
        assert r.status_code == 502 and r.headers["x-should-retry"] == "false"
        assert "refund r-3 refused" in r.json()["detail"]

    # The official openai client (which retries 5xx by default) sends it once.
    async with openai.AsyncOpenAI(base_url=f"{live_rt.url}/v1", api_key=acme, max_retries=2) as client:
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="payer", user="ann",
                                                 messages=[{"role": "user", "content": "r-4"}])
        assert e.value.status_code == 502
    async with AsyncClient(live_rt.url, acme) as sdk:
        assert (await sdk.invoke("payer", "count", user="ann"))["reply"] == "4"  # r-1, r-2, r-3, r-4: once each
